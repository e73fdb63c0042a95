"""DelTA's weights against the rules of the authors' released code (docs/source/concepts/delta.md, "The released code").

The reference below is written from those rules alone, with Python floats and loops, and never calls
``dfpo_trl.delta``: proxy v = (1 − p) h; |Â|-weighted side centroids Σ w v / max(Σ w, 1e-8) (an empty side has
the zero centroid); margins ‖v − μ_opp‖² − ‖v − μ_own‖²; γ per side = sqrt(max(population variance of the side's
margins, 1e-8)), lagging the centroids by one refinement step; both centroids refined together with α|Â|;
λ = λ_min + (λ_max − λ_min) α, λ_min for tokens of Â = 0 sequences; λ̄ = λ N / Z over all response tokens.
Each rule is also checked on a small case worked by hand, and our earlier rules are checked to be one option away.
"""

from __future__ import annotations

import math
import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from test_delta import naive_weights
from tiny import base_args, free_port

from dfpo_trl import DFPOConfig
from dfpo_trl.delta import delta_token_weights
from dfpo_trl.delta.rollout import _rollout_weights as rollout_weights
from dfpo_trl.delta.rollout import sum_over_processes, weight_reducer
from dfpo_trl.delta.weights import _token_weights_from_hidden as token_weights_from_hidden
from dfpo_trl.objectives.normalise import self_normalise

LMIN, LMAX = 0.8, 1.2
HALF = math.log(0.5)  # p = 1/2: v = h / 2


def config(**delta: Any) -> DFPOConfig:
    return DFPOConfig(**base_args(**{"token_weighting": "delta", "loss_type": "dapo", **delta}))


OLD = dict(delta_gamma="mean_abs", delta_gamma_update="current", delta_zero_advantage="one")


# ------------------------------------------------------------------------------------------------ reference
def sigmoid(x: float) -> float:
    if x >= 0:
        return 1.0 / (1.0 + math.exp(-x))
    e = math.exp(x)
    return e / (1.0 + e)


def released_reference(
    hidden: torch.Tensor, logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
    refine_steps: int = 1, lambda_min: float = LMIN, lambda_max: float = LMAX,
) -> torch.Tensor:
    """λ̄ (B, T) by the released code's rules, one token at a time in Python floats (float64)."""
    b, t, d = hidden.shape
    h, lp, adv, m = hidden.tolist(), logprobs.tolist(), advantages.tolist(), mask.tolist()
    v = {(i, j): [(1.0 - math.exp(lp[i][j])) * x for x in h[i][j]] for i in range(b) for j in range(t) if m[i][j]}
    pos = [k for k in v if adv[k[0]] > 0]
    neg = [k for k in v if adv[k[0]] < 0]

    def centroid(tokens: list, weight: dict) -> list[float]:
        total = sum(weight[k] for k in tokens)
        return [sum(weight[k] * v[k][c] for k in tokens) / max(total, 1e-8) for c in range(d)]

    def sq(x: list[float], y: list[float]) -> float:
        return sum((p - q) ** 2 for p, q in zip(x, y, strict=True))

    def margins(mu_pos: list[float], mu_neg: list[float]) -> dict:
        out = {k: sq(v[k], mu_neg) - sq(v[k], mu_pos) for k in pos}
        out.update({k: sq(v[k], mu_pos) - sq(v[k], mu_neg) for k in neg})
        return out

    def gammas(margin: dict) -> tuple[float, float]:
        out = []
        for tokens in (pos, neg):
            n = max(len(tokens), 1)
            mean = sum(margin[k] for k in tokens) / n
            var = sum(margin[k] ** 2 for k in tokens) / n - mean**2
            out.append(math.sqrt(max(var, 1e-8)))
        return out[0], out[1]

    def scores(margin: dict, gamma: tuple[float, float]) -> dict:
        return {k: sigmoid(margin[k] / gamma[0 if k in pos_set else 1]) for k in margin}

    pos_set = set(pos)
    weight = {k: abs(adv[k[0]]) for k in pos + neg}
    mu_pos, mu_neg = centroid(pos, weight), centroid(neg, weight)
    margin = margins(mu_pos, mu_neg)
    gamma = gammas(margin)
    for _ in range(refine_steps):
        alpha = scores(margin, gamma)
        refined = {k: alpha[k] * weight[k] for k in weight}
        mu_pos, mu_neg = centroid(pos, refined), centroid(neg, refined)
        gamma = gammas(margin)  # from the margins at the centroids before this update
        margin = margins(mu_pos, mu_neg)
    alpha = scores(margin, gamma)
    lam = [[0.0] * t for _ in range(b)]
    for k in v:
        lam[k[0]][k[1]] = lambda_min + (lambda_max - lambda_min) * alpha[k] if k in alpha else lambda_min
    n, z = len(v), sum(map(sum, lam))
    return torch.tensor(lam, dtype=torch.float64) * (n / max(z, 1e-8))


def random_batch(seed: int, rows: int = 8, length: int = 12, d: int = 16, advantages: list[float] | None = None):
    """8 sequences × 12 tokens, hidden 16, float64: right padding, sampled-token log-probs, two Â = 0 rows."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, length, d, generator=g, dtype=torch.float64)
    logprobs = torch.log(0.02 + 0.96 * torch.rand(rows, length, generator=g, dtype=torch.float64))
    if advantages is None:
        adv = torch.randn(rows, generator=g, dtype=torch.float64)
        adv[0], adv[1], adv[2], adv[5] = abs(adv[0]) + 0.1, -abs(adv[1]) - 0.1, 0.0, 0.0
    else:
        adv = torch.tensor(advantages, dtype=torch.float64)
    lengths = torch.randint(1, length + 1, (rows,), generator=g)
    lengths[0] = length
    mask = (torch.arange(length)[None, :] < lengths[:, None]).long()
    return hidden, logprobs, adv, mask


def hand_batch(rows: list[list[float]], advantages: list[float], mask: list[list[int]] | None = None):
    """Scalar proxies v (d = 1) given by hand: h = 2 v with p = 1/2."""
    v = torch.tensor(rows, dtype=torch.float64)
    m = torch.ones_like(v, dtype=torch.long) if mask is None else torch.tensor(mask)
    return 2.0 * v[..., None], torch.full(v.shape, HALF, dtype=torch.float64), torch.tensor(advantages).double(), m


def lam(alpha: float) -> float:
    return LMIN + (LMAX - LMIN) * alpha


def normalised(values: list[list[float]], mask: list[list[int]] | None = None) -> torch.Tensor:
    x = torch.tensor(values, dtype=torch.float64)
    m = torch.ones_like(x) if mask is None else torch.tensor(mask, dtype=torch.float64)
    return x * m * (m.sum() / (x * m).sum())


S = sigmoid
TWO_SIDED = ([[1.0, 3.0], [-1.0, -3.0]], [1.0, -1.0])  # μ± = ±2; every side's margins are {8, 24}


# --------------------------------------------------------------------------------- rule 1: γ = std of the margins
def test_gamma_is_the_population_std_of_the_sides_margins():
    """K = 0: margins {8, 24} on both sides, std 8 (mean |margin| 16): α = σ(8/8), σ(24/8)."""
    batch = hand_batch(*TWO_SIDED)
    want = normalised([[lam(S(1)), lam(S(3))]] * 2)
    torch.testing.assert_close(delta_token_weights(*batch, config(delta_refine_steps=0)), want, rtol=1e-12, atol=0)
    mean_abs = normalised([[lam(S(0.5)), lam(S(1.5))]] * 2)
    got = delta_token_weights(*batch, config(delta_refine_steps=0, delta_gamma="mean_abs"))
    torch.testing.assert_close(got, mean_abs, rtol=1e-12, atol=0)
    fixed = normalised([[lam(S(2)), lam(S(6))]] * 2)
    got = delta_token_weights(*batch, config(delta_refine_steps=0, delta_gamma=4.0))
    torch.testing.assert_close(got, fixed, rtol=1e-12, atol=0)


def test_gamma_variance_floor():
    """Every margin of a side equal: variance 0, floored at 1e-8, γ = 1e-4 (α = σ(margin / 1e-4))."""
    # one token per side at ±1: μ± = ±1, margins (1 + 1)² − 0 = 4 on both sides
    batch = hand_batch([[1.0], [-1.0]], [1.0, -1.0])
    got = delta_token_weights(*batch, config(delta_refine_steps=0))
    torch.testing.assert_close(got, normalised([[lam(S(4 / 1e-4))]] * 2), rtol=1e-12, atol=0)


# --------------------------------------------------------------------------- rule 2: γ lags the centroids
def test_gamma_lags_the_centroids_by_one_refinement_step():
    """K = 1 on the symmetric case: refined μ± = ±μ with μ = (σ(1) + 3σ(3)) / (σ(1) + σ(3)), margins 4μ v.
    Lagged: the initial γ = 8, α = σ(μ/2), σ(3μ/2). Current: γ = std(4μ, 12μ) = 4μ, α = σ(1), σ(3)."""
    batch = hand_batch(*TWO_SIDED)
    mu = (S(1) + 3 * S(3)) / (S(1) + S(3))
    lagged = normalised([[lam(S(mu / 2)), lam(S(3 * mu / 2))]] * 2)
    torch.testing.assert_close(delta_token_weights(*batch, config()), lagged, rtol=1e-12, atol=0)
    current = normalised([[lam(S(1)), lam(S(3))]] * 2)
    got = delta_token_weights(*batch, config(delta_gamma_update="current"))
    torch.testing.assert_close(got, current, rtol=1e-12, atol=0)


def test_lagged_gamma_over_two_refinements():
    """K = 2: step 1 scores with γ from the initial margins, step 2 (the final α) with γ from step 1's margins."""
    h, lp, adv, mask = random_batch(7)
    want = released_reference(h, lp, adv, mask, refine_steps=2)
    torch.testing.assert_close(delta_token_weights(h, lp, adv, mask, config(delta_refine_steps=2)), want,
                               rtol=0, atol=1e-10)
    current = delta_token_weights(h, lp, adv, mask, config(delta_refine_steps=2, delta_gamma_update="current"))
    assert (current - want).abs().max() > 1e-3


# ------------------------------------------------------------------------- rule 3: zero-advantage tokens
def test_zero_advantage_tokens_get_lambda_min_and_count_in_the_normaliser():
    """The two-sided case with padding plus an Â = 0 row of 3 tokens (its vectors never read): λ = λ_min there,
    N = 7 response tokens and Z includes 3 λ_min; padding gets 0. The old rule gives that row λ = 1."""
    mask = [[1, 1, 0], [1, 1, 0], [1, 1, 1]]
    batch = hand_batch([[1.0, 3.0, 9.0], [-1.0, -3.0, 5.0], [50.0, -70.0, 3.0]], [1.0, -1.0, 0.0], mask)
    sides = [[lam(S(1)), lam(S(3)), 0.0]] * 2
    got = delta_token_weights(*batch, config(delta_refine_steps=0))
    torch.testing.assert_close(got, normalised([*sides, [LMIN] * 3], mask), rtol=1e-12, atol=0)
    old = delta_token_weights(*batch, config(delta_refine_steps=0, delta_zero_advantage="one"))
    torch.testing.assert_close(old, normalised([*sides, [1.0] * 3], mask), rtol=1e-12, atol=0)
    assert got[2, 0] < old[2, 0] and got[0, 0] > old[0, 0]  # the effective step of every other token changes


# ------------------------------------------------------------------------------ rule 4: one side empty
def test_an_empty_side_has_the_zero_centroid_and_the_computation_goes_on():
    """All Â >= 0: μ₊ = 2, μ₋ = 0; margins 4v − 4 = {0, 8}, std 4: α = σ(0), σ(2). Refined μ₊ = μ =
    (σ(0) + 3σ(2)) / (σ(0) + σ(2)), margins 2μv − μ², lagged γ = 4. The Â = 0 row gets λ_min."""
    batch = hand_batch([[1.0, 3.0], [7.0, 7.0]], [1.0, 0.0])
    mu = (S(0) + 3 * S(2)) / (S(0) + S(2))
    want = normalised([[lam(S((2 * mu - mu**2) / 4)), lam(S((6 * mu - mu**2) / 4))], [LMIN, LMIN]])
    torch.testing.assert_close(delta_token_weights(*batch, config()), want, rtol=1e-12, atol=0)
    torch.testing.assert_close(delta_token_weights(*batch, config(delta_refine_steps=0)),
                               normalised([[lam(S(0)), lam(S(2))], [LMIN, LMIN]]), rtol=1e-12, atol=0)
    old = delta_token_weights(*batch, config(delta_zero_advantage="one"))
    assert torch.equal(old, torch.ones_like(old))  # our earlier rule: no contrast, λ = 1 everywhere


# ----------------------------------------------------------------------------------- all four together
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("refine_steps", [1, 0, 3])
def test_defaults_reproduce_the_released_rules_on_random_batches(seed, refine_steps):
    h, lp, adv, mask = random_batch(seed)
    want = released_reference(h, lp, adv, mask, refine_steps=refine_steps)
    got = delta_token_weights(h, lp, adv, mask, config(delta_refine_steps=refine_steps))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)  # float64 throughout: rounding only
    assert got.dtype == torch.float64 and (got[mask == 0] == 0).all()
    assert (got[(mask != 0) & (adv == 0)[:, None]] < 1).all()  # λ_min, below the average 1


@pytest.mark.parametrize(
    "advantages",
    [
        [0.7, 1.3, 0.0, 0.2, 0.0, 2.0, 0.4, 0.9],  # no Â < 0
        [-0.7, -1.3, 0.0, -0.2, 0.0, -2.0, -0.4, -0.9],  # no Â > 0
        [0.0] * 8,  # neither side
    ],
    ids=["no-negative", "no-positive", "all-zero"],
)
def test_defaults_reproduce_the_released_rules_with_an_empty_side(advantages):
    h, lp, adv, mask = random_batch(4, advantages=advantages)
    want = released_reference(h, lp, adv, mask)
    got = delta_token_weights(h, lp, adv, mask, config())
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
    if any(advantages):
        assert got[mask != 0].std() > 1e-3


def test_other_lambda_ranges_reproduce_the_released_rules():
    h, lp, adv, mask = random_batch(5)
    want = released_reference(h, lp, adv, mask, lambda_min=0.5, lambda_max=2.0)
    got = delta_token_weights(h, lp, adv, mask, config(delta_lambda_min=0.5, delta_lambda_max=2.0))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)


def test_float32_hidden_states_agree_with_the_float64_reference():
    """The trainer's hidden states are bf16/fp32 and are computed on in float32."""
    h, lp, adv, mask = random_batch(6)
    want = released_reference(h, lp, adv, mask)
    got = delta_token_weights(h.float(), lp.float(), adv.float(), mask, config())
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5)


# ------------------------------------------------------------------------------------ our earlier rules
def test_the_old_rules_are_one_option_setting_away():
    """delta_gamma='mean_abs', delta_gamma_update='current', delta_zero_advantage='one' give exactly our earlier
    weights (their transcription in test_delta: mean |margin| at the current centroids, λ = 1 off the contrast)."""
    h, lp, adv, mask = random_batch(3)
    old = delta_token_weights(h, lp, adv, mask, config(**OLD))
    p = lp.exp()
    lam_old = naive_weights((1 - p)[..., None] * h, adv, mask, gamma="mean_abs", gamma_update="current",
                            zero_advantage="one")
    torch.testing.assert_close(old, self_normalise(lam_old, mask) * mask, rtol=0, atol=1e-12)
    new = delta_token_weights(h, lp, adv, mask, config())
    assert (new - old).abs().max() > 1e-2  # the two differ by more than rounding


@pytest.mark.parametrize("delta", [dict(delta_gamma="mean_abs"), dict(delta_gamma_update="current"),
                                   dict(delta_zero_advantage="one")])
def test_each_rule_changes_the_weights_on_its_own(delta):
    h, lp, adv, mask = random_batch(2)
    new = delta_token_weights(h, lp, adv, mask, config())
    assert (delta_token_weights(h, lp, adv, mask, config(**delta)) - new).abs().max() > 1e-3


def test_the_function_is_the_trainer_computation():
    """The trainer's λ̄ for loss_type='dapo' on one process is delta_token_weights; for 'grpo' it is per sequence."""
    h, lp, adv, mask = random_batch(8)
    cfg = config()
    _, weights = rollout_weights(h, lp, adv, mask, cfg)
    assert torch.equal(weights, delta_token_weights(h, lp, adv, mask, cfg))
    raw, per_sequence = rollout_weights(h, lp, adv, mask, config(loss_type="grpo"))
    torch.testing.assert_close(raw, token_weights_from_hidden(h, lp.exp(), adv, mask))
    torch.testing.assert_close((per_sequence * mask).sum(1), mask.sum(1).double())
    assert weight_reducer(cfg, 1) is None and weight_reducer(config(delta_scope="process"), 2) is None
    assert weight_reducer(cfg, 2) is sum_over_processes


# ------------------------------------------------------------------------------------------------- config
@pytest.mark.parametrize(
    ("delta", "message"),
    [
        (dict(delta_gamma=None), r"delta_gamma=None is no longer accepted.*'std'.*'mean_abs'"),
        (dict(delta_gamma="median"), r"delta_gamma='median' is not valid"),
        (dict(delta_gamma=0.0), r"delta_gamma=0.0 is not valid"),
        (dict(delta_gamma_update="eager"), r"delta_gamma_update='eager' is not valid; use 'lagged' or 'current'"),
        (dict(delta_zero_advantage="zero"), r"delta_zero_advantage='zero' is not valid; use 'lambda_min' or 'one'"),
        (dict(delta_scope="node"), r"delta_scope='node' is not valid; use 'global' or 'process'"),
    ],
)
def test_new_fields_refuse_bad_values_naming_the_field(delta, message):
    with pytest.raises(ValueError, match=message):
        config(**delta)


def test_defaults_and_numeric_gamma():
    cfg = config()
    assert (cfg.delta_gamma, cfg.delta_gamma_update, cfg.delta_zero_advantage, cfg.delta_scope) == (
        "std", "lagged", "lambda_min", "global")
    assert config(delta_gamma="0.5").delta_gamma == 0.5 and config(delta_gamma=2).delta_gamma == 2.0
    with pytest.raises(ValueError, match="DelTA options have no effect"):
        DFPOConfig(**base_args(delta_scope="process"))


def test_command_line_accepts_names_and_numbers_for_delta_gamma():
    from dfpo_trl.cli.parser import make_parser

    parser = make_parser()
    for value, want in (("mean_abs", "mean_abs"), ("0.25", 0.25)):
        _, cfg, _ = parser.parse_args_and_config(
            ["--output_dir", "/tmp/dfpo-test-out", "--token_weighting", "delta", "--loss_type", "dapo",
             "--use_cpu", "true", "--report_to", "none", "--delta_gamma", value, "--delta_scope", "process"]
        )
        assert cfg.delta_gamma == want and cfg.delta_scope == "process"


# ---------------------------------------------------------------------------------------------- processes
def _scope_worker(rank: int, world: int, port: int, data: dict[str, torch.Tensor], configs: dict, out: Any) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        rows = slice(rank * 4, (rank + 1) * 4)
        for scope, cfg in configs.items():
            _, weights = rollout_weights(
                data["hidden"][rows], data["logprobs"][rows], data["adv"][rows], data["mask"][rows], cfg,
                all_reduce=weight_reducer(cfg, world),
            )
            out.put((rank, scope, weights.numpy()))  # by value (see below)
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
def test_process_scope_equals_each_shard_alone_and_global_scope_the_whole_batch():
    """Two gloo processes, 4 rows each; the first holds no Â < 0 row (one side empty on that shard)."""
    h, lp, _, mask = random_batch(9)
    adv = torch.tensor([0.5, 1.0, 0.0, 0.3, -0.4, 0.9, 0.0, -1.1], dtype=torch.float64)
    data = {"hidden": h, "logprobs": lp, "adv": adv, "mask": mask}
    configs = {"process": config(delta_scope="process"), "global": config()}
    port = free_port()
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    procs = [ctx.Process(target=_scope_worker, args=(r, 2, port, data, configs, out)) for r in range(2)]
    for p in procs:
        p.start()
    # The ranks send numpy copies: a tensor would travel as a shared-memory handle that cannot be opened once
    # its rank has exited (EOFError or FileNotFoundError here, intermittently).
    results = [out.get(timeout=120) for _ in range(4)]  # a rank that dies or hangs fails here, not CI
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    got = {(rank, scope): torch.from_numpy(w) for rank, scope, w in results}
    for rank in range(2):
        rows = slice(rank * 4, (rank + 1) * 4)
        alone = delta_token_weights(h[rows], lp[rows], adv[rows], mask[rows], configs["process"])
        torch.testing.assert_close(got[(rank, "process")], alone, rtol=0, atol=1e-12)
        torch.testing.assert_close(got[(rank, "process")], released_reference(h[rows], lp[rows], adv[rows],
                                                                              mask[rows]), rtol=0, atol=1e-10)
    whole = torch.cat([got[(0, "global")], got[(1, "global")]])
    torch.testing.assert_close(whole, delta_token_weights(h, lp, adv, mask, configs["global"]), rtol=0, atol=1e-12)
    assert (whole - torch.cat([got[(0, "process")], got[(1, "process")]])).abs().max() > 1e-3
