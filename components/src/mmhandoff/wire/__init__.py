"""Every message between components: the Handoff (handoff) and the rest (messages)."""
