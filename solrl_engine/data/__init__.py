"""Prompt sets by name: "shapes/train", "shapes/heldout" (the bundled world), or a text file with
one prompt per line."""

from __future__ import annotations

from pathlib import Path


def load_prompts(spec: str) -> list[str]:
    """The prompts named by `spec`; a clear error when there are none."""
    if spec.startswith("shapes/"):
        from solrl_engine.data import shapes

        return shapes.prompts(spec.split("/", 1)[1])
    path = Path(spec)
    if path.is_file():
        prompts = [line.strip() for line in path.read_text().splitlines() if line.strip()]
        if not prompts:
            raise ValueError(f"prompt file {path} has no prompts (one per line)")
        return prompts
    raise ValueError(f"unknown prompt set {spec!r}: use shapes/train, shapes/heldout or a .txt file path")
