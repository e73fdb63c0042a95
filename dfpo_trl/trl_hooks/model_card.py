"""What a DFPO model card says: the method's name, tags and papers, in the form TRL's trainers declare them.

TRL writes a card (``README.md`` in ``output_dir``) at every checkpoint and on ``push_to_hub`` from three class
attributes of the trainer: ``_name`` ("This model was trained with ..."), ``_tag_names`` (the card's tags, also
added to the model so a hub push carries them) and ``_paper`` (title, arXiv id, BibTeX). ``DFPOTrainer`` inherits
GRPO's from ``GRPOTrainer``, so without its own every card would describe a GRPO run and cite DeepSeekMath. TRL's
card has room for one paper; with DelTA on, :func:`add_delta_to_card` adds DelTA's sentence and citation to the
card TRL wrote.
"""

from __future__ import annotations

import os
import textwrap
from pathlib import Path
from typing import Any

__all__ = ["DELTA_PAPER", "DELTA_TAG", "DFPO_NAME", "DFPO_PAPER", "DFPO_TAGS", "DFPOModelCard", "add_delta_to_card",
           "card_tags"]

DFPO_NAME = "DFPO"
DFPO_TAGS: tuple[str, ...] = ("trl", "dfpo")
DELTA_TAG = "delta"

DFPO_PAPER: dict[str, str] = {
    "title": "Design Conditions for Intra-Group Learning of Sequence-Level Rewards: Token Gradient Cancellation",
    "id": "2604.13088",
    # docstyle-ignore
    "citation": textwrap.dedent("""\
        @article{ding2026designconditions,
            title        = {{Design Conditions for Intra-Group Learning of Sequence-Level Rewards: Token Gradient Cancellation}},
            author       = {Fei Ding and Yongkang Zhang and Youwei Wang and Zijian Zeng},
            year         = 2026,
            eprint       = {arXiv:2604.13088},
        }"""),  # noqa: E501
}

DELTA_PAPER: dict[str, str] = {
    "title": "DelTA: Discriminative Token Credit Assignment for Reinforcement Learning from Verifiable Rewards",
    "id": "2605.21467",
    # docstyle-ignore
    "citation": textwrap.dedent("""\
        @article{zhang2026deltadiscriminativetokencredit,
            title        = {{DelTA: Discriminative Token Credit Assignment for Reinforcement Learning from Verifiable Rewards}},
            author       = {Kaiyi Zhang and Wei Wu and Yankai Lin},
            year         = 2026,
            eprint       = {arXiv:2605.21467},
        }"""),  # noqa: E501
}

# Lines of TRL 1.16's card template (trl/templates/lm_model_card.md) that DelTA's text is placed after / before.
_TRAINED_WITH = "This model was trained with "
_CITE_TRL = "Cite TRL as:"


def card_tags(token_weighting: str) -> list[str]:
    """The card's tags for a run: ``trl``, ``dfpo``, and ``delta`` when DelTA weights the tokens."""
    tags = list(DFPO_TAGS)
    if token_weighting == "delta":
        tags.append(DELTA_TAG)
    return tags


def add_delta_to_card(path: str | Path) -> None:
    """Add DelTA to a card TRL wrote for DFPO: a sentence after TRL's "trained with" line and DelTA's BibTeX
    before TRL's own citation (at the end if a TRL release moved either line). Run once per card written."""
    card = Path(path)
    lines = card.read_text(encoding="utf-8").split("\n")
    sentence = (
        f'Its per-token weights come from DelTA (`token_weighting="delta"`), introduced in '
        f"[{DELTA_PAPER['title']}](https://huggingface.co/papers/{DELTA_PAPER['id']})."
    )
    citation = ["Cite DelTA as:", "", "```bibtex", *DELTA_PAPER["citation"].split("\n"), "```", ""]
    trained = next((i for i, line in enumerate(lines) if line.startswith(_TRAINED_WITH)), None)
    if trained is not None:
        lines[trained + 1 : trained + 1] = ["", sentence]
    cite_trl = next((i for i, line in enumerate(lines) if line.startswith(_CITE_TRL)), None)
    if cite_trl is not None:
        lines[cite_trl:cite_trl] = citation
    else:
        lines += ["", *([] if trained is not None else [sentence, ""]), *citation]
    card.write_text("\n".join(lines), encoding="utf-8")


class DFPOModelCard:
    """The model-card half of ``DFPOTrainer`` (a mixin before ``trl.GRPOTrainer`` in its bases): DFPO's name, tags
    and citation as the class attributes TRL's card reads, and DelTA's sentence and citation added to the card TRL
    wrote when DelTA weights the tokens (TRL's card has room for one paper)."""

    _name = DFPO_NAME
    _tag_names = list(DFPO_TAGS)
    _paper = DFPO_PAPER

    def create_model_card(self, *args: Any, **kwargs: Any) -> None:
        super().create_model_card(*args, **kwargs)  # type: ignore[misc]
        if DELTA_TAG in self._tag_names and self.is_world_process_zero():  # type: ignore[attr-defined]
            add_delta_to_card(os.path.join(self.args.output_dir, "README.md"))  # type: ignore[attr-defined]
