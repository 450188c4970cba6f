"""What the tiny models' builders share (models.tiny, models.tiny_qwen2_vl): the seed, a
tokenizer trained on a fixed corpus, files without library version stamps, and a digest that
says two builds are byte-identical."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

VOCAB_SIZE = 512
SEED = 1234

_CORPUS = [
    "USER: <image>\nWhat is shown in this image? ASSISTANT: A picture of a cat on a red sofa.",
    "SYSTEM: You are a helpful assistant that describes pictures briefly and precisely.",
    "Describe the colours, the shapes and the objects. Compare the two images. Count the dots.",
    "The quick brown fox jumps over the lazy dog. 0123456789 !?.,;:'\"()[]{}<>/\\-_+=*&^%$#@~`|",
]


def train_bpe(specials: list[str], unk: str | None = None):
    """A byte-level BPE tokenizer of VOCAB_SIZE trained on the fixed corpus (deterministic)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE(unk_token=unk))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=specials, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(_CORPUS * 4, trainer=trainer)
    return bpe


def drop_volatile_fields(out: Path, names: tuple[str, ...] = (
        "config.json", "tokenizer_config.json", "preprocessor_config.json")) -> None:
    """Remove the library version stamps so the files depend only on this module."""
    for name in names:
        path = out / name
        if path.exists():
            data = json.loads(path.read_text())
            data.pop("transformers_version", None)
            path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def tree_digest(folder: str | os.PathLike) -> str:
    """sha256 over every file's relative name and bytes: equal digests mean identical builds."""
    h = hashlib.sha256()
    for p in sorted(Path(folder).rglob("*")):
        if p.is_file():
            h.update(str(p.relative_to(folder)).encode() + b"\0" + p.read_bytes())
    return h.hexdigest()
