"""The script arguments: what a recipe sets besides DFPOConfig and ModelConfig (task, data, evaluation, outputs).

Also :class:`RecipeError`, the error of a recipe or command line that does not describe a run, and
:class:`ModelUnavailableError`, a model that cannot be loaded (both light: the command line catches them before
torch is imported).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .files import PLOT_FILE


@dataclass
class DFPOScriptArguments:
    """What to train on and how to measure it: the task, its data, the held-out evaluation and the outputs."""

    task: str = field(
        default="arithmetic",
        # The registered tasks are listed from dfpo_trl.cli.tasks.TASKS when the parser is built (make_parser).
        metadata={"help": "Task: a registered name or an import path 'package.module:factory' returning a "
                  "dfpo_trl.cli.tasks.Task."},
    )
    dataset: str | None = field(
        default=None,
        metadata={"help": "math task: hub name or local path of the dataset (datasets.load_dataset)."},
    )
    dataset_config: str | None = field(
        default=None, metadata={"help": "math task: configuration name of the dataset (e.g. 'main' for gsm8k)."}
    )
    split: str = field(default="train", metadata={"help": "math task: split to train on."})
    test_split: str = field(default="test", metadata={"help": "math task: split of the held-out problems."})
    problem_column: str = field(default="problem", metadata={"help": "math task: column holding the problem."})
    answer_column: str = field(default="answer", metadata={"help": "math task: column holding the gold answer."})
    instruction: str | None = field(
        default=None,
        metadata={
            "help": "math task: text appended to every problem (default: ask for step-by-step reasoning and a "
            "\\boxed{} answer); '' for none, when the dataset's prompts carry their own instruction."
        },
    )
    reward_funcs: list[str] | None = field(
        default=None,
        metadata={
            "help": "Reward functions replacing the task's own: 'arithmetic_correct', 'math_verify_correct', TRL's "
            "'accuracy_reward', 'reasoning_accuracy_reward', 'think_format_reward', an import path "
            "'package.module:function', or a reward model (a local directory or a hub id 'org/name', which TRL "
            "loads as a sequence classifier). Default: the task's. Weights: reward_weights."
        },
    )
    train_size: int | None = field(
        default=None, metadata={"help": "Training prompts (default: the task's; math: the whole split)."}
    )
    max_prompt_length: int | None = field(
        default=None,
        metadata={
            "help": "Drop training prompts longer than this many tokens (chat template applied). TRL 1.16 has no "
            "prompt truncation; max_prompt_length + max_completion_length is the context a rollout needs."
        },
    )
    eval_size: int = field(
        default=100,
        metadata={"help": "Held-out problems whose greedy accuracy is measured before and after training."},
    )
    eval_max_new_tokens: int = field(default=32, metadata={"help": "Greedy tokens per held-out problem."})
    eval_batch_size: int = field(default=32, metadata={"help": "Held-out problems per generate call."})
    skip_eval: bool = field(default=False, metadata={"help": "Skip the held-out accuracy before and after."})
    reward_threshold: float = field(
        default=0.6,
        metadata={
            "help": "Threshold κ of the compute-to-threshold metric in the summary: first step where the EMA(0.3) "
            "of the mean training reward reaches it (eq. 19)."
        },
    )
    eval_every: int = field(
        default=0,
        metadata={
            "help": "Also measure the held-out greedy accuracy every this many optimizer steps (0: before and after "
            "training only); logged as heldout/accuracy, kept in the summary's heldout.curve."
        },
    )
    drift_every: int = field(
        default=0,
        metadata={
            "help": "Equivalent-solution drift meter (docs/source/concepts/metrics.md): every this many optimizer "
            "steps, score drift_size held-out prompts' equally rewarded answer forms with the current policy and log "
            "drift/* (the "
            "log-odds between forms, the entropy over them, each form's share of the sampled correct completions). "
            "0: off. Needs a task with equivalent forms: two_forms, sum_sentence."
        },
    )
    drift_size: int = field(default=32, metadata={"help": "Held-out problems the drift meter scores."})
    save_model: bool = field(default=True, metadata={"help": "Save the trained model to output_dir."})
    plot: bool = field(default=True, metadata={"help": f"Write {PLOT_FILE} (needs matplotlib) to output_dir."})
    plugins: list[str] | None = field(
        default=None,
        metadata={
            "help": "Modules imported first, to register transforms, tasks or rewards "
            "(docs/source/guides/custom_transform.md)."
        },
    )

    def __post_init__(self) -> None:
        if isinstance(self.plugins, str):  # a recipe's `plugins: my_module`
            self.plugins = [self.plugins]
        for name in ("eval_every", "drift_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 optimizer steps (0: off), got {getattr(self, name)}")
        if self.drift_size < 1:
            raise ValueError(f"drift_size must be >= 1 held-out problems, got {self.drift_size}")


class RecipeError(ValueError):
    """A recipe or command line that does not describe a run: unknown field, bad value, missing data."""



class ModelUnavailableError(RuntimeError):
    """The requested model cannot be loaded (typically: a hub id without network access)."""
