"""Tool calls end to end: TRL's own tool loop (``tools=`` and ``environment_factory=``) under DFPO's layouts.

TRL runs a tool call in the middle of a rollout and splices the tool's answer into the completion; those tokens are
not the policy's, so TRL's ``tool_mask`` is 0 there and its loss mask is ``completion_mask * tool_mask``. DFPO reads
the same loss mask wherever it forms s̄ (the sequence log-ratio ρ_i, eq. 44, is TRL's GSPO mean over the tokens TRL's
loss counts), and every layout moves ``tool_mask`` with its row. Checked here on real rollouts of a tiny model with
one tool, ``add(a, b)``, trained with Min-Replace off-policy in the group-granular, pre-pass and redistributed
layouts:

* rollouts contain tool calls and results (``tool_mask`` has zeros), and the zeros sit exactly on the spliced tool
  turn (``<tool> result <end> <assistant>``) of the row they belong to, after every regrouping;
* the gradient of the loss with respect to each token's log-prob (the real backward of TRL's loss) is exactly 0 at
  tool-result positions, and at the policy's own tokens it is DFPO's -Â_i s̃_i / (B · accumulation · L_i) with L_i
  counting only them (non-zero in some rows that called the tool);
* s̄ used by the transform is the sign-aware post-clip of exp(ρ) with ρ over ``completion_mask * tool_mask``, not
  over the completion mask alone (which differs measurably once the policy has moved);
* the loss is finite at every step.

The tiny model is a random Llama whose ``generate`` samples through a grammar (a logits processor that only sets
disallowed tokens to -inf): its rollouts either answer directly or emit ``<call> add a = 3 b = 4 </call>``, which
TRL parses with the tokenizer's ``response_template``, runs, and continues generating after. Training log-probs are
the unconstrained model's, as TRL computes them.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from datasets import Dataset
from masked_loss import RecordingTrainer, check_token_gradient, sequence_weights, start_recording
from tiny import base_args, end_rank, free_port, spawn_ranks
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, LogitsProcessor, LogitsProcessorList, PreTrainedTokenizerFast

from dfpo_trl import DFPOConfig

pytestmark = pytest.mark.usefixtures("one_thread")

TOOL_WORDS = ["<pad>", "<end>", "<user>", "<assistant>", "<tool>", "<call>", "</call>", "<tools>", "</tools>",
              "add", "a", "b", "=", "+", "Compute"] + list("0123456789")
ID = {word: i for i, word in enumerate(TOOL_WORDS)}
DIGITS = [ID[d] for d in "0123456789"]

# A chat template that renders a whole tool-calling conversation (TRL checks it can: `supports_tool_calling`) and
# renders earlier turns the same whatever follows (TRL's `is_chat_template_prefix_preserving`). Words are separated
# by spaces: the tokenizer splits on whitespace.
CHAT_TEMPLATE = (
    "{% if tools %}<tools> {% for tool in tools %}{{ tool.function.name }} {% endfor %}</tools> {% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'user' %}<user> {{ message.content }} <end> "
    "{% elif message.role == 'assistant' %}<assistant> {{ message.content }} "
    "{% for call in message.tool_calls or [] %}<call> {{ call.function.name }} "
    "{% for key, value in call.function.arguments.items() %}{{ key }} = {{ value }} {% endfor %}</call> "
    "{% endfor %}<end> "
    "{% elif message.role == 'tool' %}<tool> {{ message.content }} <end> "
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<assistant> {% endif %}"
)
# How transformers' `parse_response` (which TRL calls on every completion) reads a tool call back: the new-style
# response template of transformers >= 5.13.
RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<assistant>",
    "fields": {
        "tool_calls": {
            "open_pattern": r"<call>\s*(?P<name>\w+)",
            "close_pattern": r"</call>\s*",
            "repeats": True,
            "content": "xml-inline",
            "content_args": {"tag_pattern": r"(?P<key>\w+)\s*=\s*(?P<value>\d+)"},
            "transform": {"type": "function", "function": {"name": "{name}", "arguments": "{content}"}},
        },
        "content": {"close_pattern": r"<end>\s*", "content": "text"},
    },
}
# The only tool call the grammar allows; "D" is any digit.
CALL = ["<call>", "add", "a", "=", "D", "b", "=", "D", "</call>", "<end>"]
TOOL_TURN_START = ID["<tool>"]

MIN_REPLACE = dict(
    importance_sampling_level="sequence", loss_type="grpo", epsilon=0.2, epsilon_high=0.28,
    group_transform="min_replace", max_completion_length=24, learning_rate=0.05, temperature=1.0,
)
LAYOUTS = {
    # per-device batch a multiple of G: whole groups in every micro-batch
    "group_granular": dict(per_device_train_batch_size=4, num_generations=4, steps_per_generation=2,
                           gradient_accumulation_steps=1, max_steps=4),
    # per-device batch 3, G = 4: groups spread over micro-steps, a pre-pass per optimizer step
    "pre_pass": dict(per_device_train_batch_size=3, num_generations=4, steps_per_generation=4,
                     gradient_accumulation_steps=2, max_steps=4),
}
# 2 processes x per-device batch 2 = G: whole groups across processes in every micro-step
REDISTRIBUTED = dict(per_device_train_batch_size=2, num_generations=4, steps_per_generation=2,
                     gradient_accumulation_steps=1, max_steps=4)


def tool_tokenizer() -> PreTrainedTokenizerFast:
    """Word-level tokenizer with a tool-calling chat template and a response template (no hub access)."""
    backend = Tokenizer(models.WordLevel(ID, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Digits(individual_digits=True)]
    )
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<end>")
    tokenizer.padding_side = "left"
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.response_template = RESPONSE_TEMPLATE
    return tokenizer


def add(a: int, b: int) -> int:
    """Adds two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


class AddEnvironment:
    """An ``environment_factory`` environment: its public methods are the tools."""

    def reset(self, **_: Any) -> None:
        return None

    def add(self, a: int, b: int) -> int:
        """Adds two integers.

        Args:
            a: The first integer.
            b: The second integer.
        """
        return a + b


class ToolGrammar(LogitsProcessor):
    """Allowed next tokens of the current assistant turn (the tokens after the last ``<assistant>``): a direct
    answer of one or two digits, or, before any tool result, the ``add`` call. Disallowed tokens get -inf; allowed
    ones keep the model's logits, except ``<call>``, which is lifted to the digits' log-sum-exp so that about half
    of the rollouts call the tool."""

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        out = torch.full_like(scores, float("-inf"))
        for row, ids in enumerate(input_ids.tolist()):
            turn = ids[len(ids) - ids[::-1].index(ID["<assistant>"]) :]
            if ID["<end>"] in turn:  # finished: generate pads it
                out[row] = scores[row]
                continue
            after_tool = TOOL_TURN_START in ids
            allowed = self._allowed(turn, after_tool)
            out[row, allowed] = scores[row, allowed]
            if not turn and not after_tool:
                out[row, ID["<call>"]] = torch.logsumexp(scores[row, DIGITS], 0)
        return out

    @staticmethod
    def _allowed(turn: list[int], after_tool: bool) -> list[int]:
        if not turn:
            return DIGITS if after_tool else [ID["<call>"], *DIGITS]
        if turn[0] == ID["<call>"]:
            expected = CALL[len(turn)]
            return DIGITS if expected == "D" else [ID[expected]]
        return [*DIGITS, ID["<end>"]] if len(turn) < 2 else [ID["<end>"]]


class ToolCallingLlama(LlamaForCausalLM):
    """A random Llama whose sampling follows :class:`ToolGrammar` (its forward, hence training, is unchanged)."""

    def generate(self, *args: Any, **kwargs: Any):
        kwargs["logits_processor"] = LogitsProcessorList([ToolGrammar()])
        return super().generate(*args, **kwargs)


def tool_model(seed: int = 0) -> ToolCallingLlama:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(TOOL_WORDS), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        pad_token_id=ID["<pad>"], eos_token_id=ID["<end>"], bos_token_id=ID["<user>"], tie_word_embeddings=False,
    )
    return ToolCallingLlama(config)


def tool_dataset(n: int = 16, seed: int = 0) -> Dataset:
    g = torch.Generator().manual_seed(seed)
    pairs = torch.randint(0, 10, (n, 2), generator=g).tolist()
    return Dataset.from_dict({
        "prompt": [[{"role": "user", "content": f"Compute {a} + {b} ="}] for a, b in pairs],
        "answer": [str(a + b) for a, b in pairs],
    })


def tool_reward(completions: list[list[dict]], answer: list[str], **_: Any) -> list[float]:
    """1 for using the tool, plus 1 for a final answer equal to the sum: groups that mix both have signal."""
    rewards = []
    for messages, target in zip(completions, answer, strict=True):
        used_tool = any(message["role"] == "tool" for message in messages)
        final = messages[-1].get("content", "").replace(" ", "") if messages[-1]["role"] == "assistant" else ""
        rewards.append(float(used_tool) + float(final == target))
    return rewards


def build_trainer(sizes: dict[str, Any], source: str = "tools") -> RecordingTrainer:
    tools = dict(tools=[add]) if source == "tools" else dict(environment_factory=AddEnvironment)
    return start_recording(RecordingTrainer(
        model=tool_model(), reward_funcs=tool_reward, train_dataset=tool_dataset(), processing_class=tool_tokenizer(),
        args=DFPOConfig(**base_args(**{**MIN_REPLACE, **sizes})), **tools,
    ))


def check_records(trainer: RecordingTrainer) -> dict[str, float]:
    """The per-micro-step checks of the module docstring; returns counts for the checks across processes."""
    assert trainer.records, "no training step ran"
    eps_low, eps_high = trainer.epsilon_low, trainer.epsilon_high
    accumulation = trainer.args.gradient_accumulation_steps
    stats = dict(tool_tokens=0.0, rows_with_tool=0.0, graded_tool_rows=0.0, transform_acted=0.0, mask_matters=0.0)
    for record in trainer.records:
        inputs, grad = record["inputs"], record["grad"]
        assert torch.isfinite(record["loss"]), record["loss"]
        assert "tool_mask" in inputs, sorted(inputs)
        completion_mask, tool_mask, ids = inputs["completion_mask"], inputs["tool_mask"], inputs["completion_ids"]
        assert tool_mask.shape == completion_mask.shape == ids.shape == grad.shape
        loss_mask = completion_mask * tool_mask
        tool_result = (tool_mask == 0) & (completion_mask == 1)
        for row in range(ids.size(0)):
            span = tool_result[row].nonzero().squeeze(1)
            if span.numel() == 0:
                assert TOOL_TURN_START not in ids[row][completion_mask[row] == 1].tolist(), ids[row]
                continue
            # the zeros are this row's tool turn, contiguous, right after its call's <end>
            turn = ids[row, span].tolist()
            assert span.tolist() == list(range(int(span[0]), int(span[-1]) + 1)), span
            assert turn[0] == TOOL_TURN_START and turn[-1] == ID["<assistant>"], turn
            assert turn[-2] == ID["<end>"] and all(t in DIGITS for t in turn[1:-2]), turn
            assert ids[row, : int(span[0])].tolist() == [ID[w] if w != "D" else ids[row, k].item()
                                                          for k, w in enumerate(CALL)], ids[row]
            stats["rows_with_tool"] += 1
            stats["tool_tokens"] += span.numel()
            if bool((grad[row][loss_mask[row] == 1] != 0).any()):
                stats["graded_tool_rows"] += 1
        # exactly no gradient where TRL's loss does not count the token (tool results, padding), and the exact
        # DFPO gradient on the policy's own tokens, with L_i counting only them
        check_token_gradient(record, loss_mask, eps_low, eps_high, accumulation)
        # s̄ is ρ over completion_mask * tool_mask (TRL's GSPO mask), computed here independently
        weights = record["weights"]
        s_bar = sequence_weights(record, loss_mask, eps_low, eps_high)[1]
        torch.testing.assert_close(weights["s_bar"].double(), s_bar, rtol=1e-4, atol=1e-5)
        s_bar_without_tool_mask = sequence_weights(record, completion_mask, eps_low, eps_high)[1]
        stats["mask_matters"] = max(stats["mask_matters"], float((s_bar_without_tool_mask - s_bar).abs().max()))
        stats["transform_acted"] = max(stats["transform_acted"],
                                       float((weights["s_tilde"] - weights["s_bar"]).abs().max()))
    return stats


def assert_tool_training(stats: dict[str, float]) -> None:
    assert stats["tool_tokens"] > 0, "no rollout called the tool"
    assert stats["graded_tool_rows"] > 0, "no row with a tool call got a gradient on its own tokens"
    assert stats["transform_acted"] > 1e-3, "Min-Replace never changed a weight: the run is on-policy"
    # A test that s̄ uses the tool mask can only fail where counting the tool tokens would change s̄.
    assert stats["mask_matters"] > 1e-3, stats


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_tool_results_carry_no_gradient(layout: str) -> None:
    trainer = build_trainer(LAYOUTS[layout])
    assert trainer.group_layout == layout
    trainer.train()
    assert len(trainer.records) == LAYOUTS[layout]["max_steps"] * LAYOUTS[layout]["gradient_accumulation_steps"]
    assert_tool_training(check_records(trainer))
    assert any("tools/call_frequency" in h and h["tools/call_frequency"] > 0 for h in trainer.state.log_history)


@pytest.mark.filterwarnings("ignore:You are using 'environment_factory':UserWarning")
def test_environment_factory_tool_results_carry_no_gradient() -> None:
    """The ``environment_factory`` path produces the same ``tool_mask`` and gets the same treatment."""
    trainer = build_trainer(LAYOUTS["pre_pass"], source="environment")
    assert trainer.group_layout == "pre_pass"
    trainer.train()
    assert_tool_training(check_records(trainer))


def redistributed_worker(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE="2")
    torch.set_num_threads(1)
    trainers = [build_trainer(REDISTRIBUTED)]
    assert trainers[0].group_layout == "redistributed"
    trainers[0].train()
    stats = check_records(trainers[0])
    stats["micro_steps"] = float(len(trainers[0].records))
    torch.save(stats, Path(out_dir) / f"stats{rank}.pt")
    end_rank(trainers)


@pytest.mark.distributed
def test_redistributed_tool_results_carry_no_gradient(tmp_path: Path) -> None:
    spawn_ranks(redistributed_worker, (free_port(), str(tmp_path)), nprocs=2)
    per_rank = [torch.load(tmp_path / f"stats{rank}.pt") for rank in range(2)]
    assert all(stats["micro_steps"] == REDISTRIBUTED["max_steps"] for stats in per_rank)
    combined = {key: max(stats[key] for stats in per_rank) for key in per_rank[0]}
    combined["tool_tokens"] = sum(stats["tool_tokens"] for stats in per_rank)
    assert_tool_training(combined)
