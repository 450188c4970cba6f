"""Images: decoding, limits and content hashes (images); fetching image URLs behind a guard
(fetch)."""
