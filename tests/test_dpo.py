"""Direct preference optimisation's loss and metrics against the formulas written out in NumPy,
a sequence's log-probability against the whole logits', and (with the peers extra) the loss and
TRL's reward metrics against TRL's DPOTrainer on two random checkpoints."""

import functools
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import SMALL, import_peer, init_params, jit_apply, torch_peer, trl_dpo_metrics, trl_dpo_trainer

sys.path.insert(0, str(Path(__file__).resolve().parent / "text"))
from checkpoints import save_random_checkpoint  # noqa: E402

from jaxformer import Decoder  # noqa: E402
from jaxformer.convert import load_hf  # noqa: E402
from jaxformer.dpo import METRICS, dpo_metrics, dpo_sums, dpo_terms, sequence_logps  # noqa: E402
from jaxformer.text import load_tokenizer  # noqa: E402
from jaxformer.text.dataset import IGNORE, rows  # noqa: E402
from jaxformer.text.preference import pair_of  # noqa: E402

LN2 = np.float32(np.log(2.0))


def _numpy_dpo(logps, ref_logps, beta, weights):
    """The loss and `METRICS` in float64, written out: each pair's rewards
    `r = beta * (log pi - log pi_ref)` of its chosen and rejected answer, its loss
    `-log sigmoid(r_chosen - r_rejected)`, its accuracy `r_chosen > r_rejected`, its margin
    `r_chosen - r_rejected`, each averaged over the pairs with their weights."""
    policy_chosen, policy_rejected = np.split(np.asarray(logps, np.float64), 2)
    ref_chosen, ref_rejected = np.split(np.asarray(ref_logps, np.float64), 2)
    chosen, rejected = beta * (policy_chosen - ref_chosen), beta * (policy_rejected - ref_rejected)
    per_pair = {"loss": -np.log(1.0 / (1.0 + np.exp(-(chosen - rejected)))),
                "rewards/chosen": chosen, "rewards/rejected": rejected,
                "rewards/accuracies": (chosen > rejected).astype(np.float64), "rewards/margins": chosen - rejected,
                "logps/chosen": policy_chosen, "logps/rejected": policy_rejected}
    weights = np.asarray(weights, np.float64)
    return {name: np.sum(weights * value) / np.sum(weights) for name, value in per_pair.items()}


def _pairs_logps(rng, n):
    """Float32 log-probabilities `[2 n]` of `n` pairs (the chosen answers', then the rejected) under
    a policy and a reference, sums of a few dozen tokens; pairs 0 and 1 exact ties, the policy
    being the reference on both their answers (both rewards exactly 0)."""
    logps = -rng.uniform(10.0, 120.0, 2 * n).astype(np.float32)
    ref_logps = (logps + rng.normal(0.0, 4.0, 2 * n)).astype(np.float32)
    for pair in (0, 1):
        ref_logps[[pair, n + pair]] = logps[[pair, n + pair]]
    return logps, ref_logps


@pytest.mark.parametrize("beta", [0.1, 0.5, 2.0])
def test_terms_and_metrics_are_the_formulas_and_filler_pairs_weigh_nothing(beta):
    """`dpo_terms`, `dpo_metrics` and `dpo_sums` against `_numpy_dpo` in float64, at 1e-6: float32
    rounds each of the few operations per pair, then the means, at 6e-8 relative each. A tie
    (pairs 0 and 1) is no accuracy: TRL's `chosen > rejected` is strict. Filler pairs (weight 0)
    change nothing; a split's means are its batches' sums added over their counts added."""
    n = 8
    logps, ref_logps = _pairs_logps(np.random.default_rng(1), n)
    terms = dpo_terms(jnp.asarray(logps), jnp.asarray(ref_logps), beta)
    chosen, rejected = (beta * x for x in np.split(logps.astype(np.float64) - ref_logps, 2))
    np.testing.assert_allclose(terms["chosen"], chosen, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(terms["rejected"], rejected, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(terms["loss"], np.log1p(np.exp(rejected - chosen)), rtol=1e-6, atol=1e-6)
    assert {name: x.dtype for name, x in terms.items()} == dict.fromkeys(("loss", "chosen", "rejected"), jnp.float32)

    weights = np.array([1, 1, 0, 1, 1, 0, 1, 1], np.float32)  # pairs 2 and 5: filler
    loss, metrics = dpo_metrics(jnp.asarray(logps), jnp.asarray(ref_logps), beta, jnp.asarray(weights))
    want = _numpy_dpo(logps, ref_logps, beta, weights)
    assert list(metrics) == list(METRICS)
    assert 0 < want["rewards/accuracies"] < 1  # the accuracies differ among the pairs, the ties counting 0
    np.testing.assert_allclose(float(loss), want["loss"], rtol=1e-6, atol=1e-6)
    for name in METRICS:
        np.testing.assert_allclose(float(metrics[name]), want[name], rtol=1e-6, atol=1e-6, err_msg=name)
    # The filler pairs left out altogether: the same means.
    kept = np.flatnonzero(weights)
    rows_kept = np.concatenate([kept, n + kept])
    alone_loss, alone = dpo_metrics(jnp.asarray(logps[rows_kept]), jnp.asarray(ref_logps[rows_kept]), beta)
    np.testing.assert_allclose(float(alone_loss), float(loss), rtol=1e-6, atol=1e-6)
    for name in METRICS:
        np.testing.assert_allclose(float(alone[name]), float(metrics[name]), rtol=1e-6, atol=1e-6, err_msg=name)
    # Two batches of four pairs: their sums added over their counts added are the means over all eight.
    halves = [np.concatenate([np.arange(4) + 4 * h, n + np.arange(4) + 4 * h]) for h in (0, 1)]
    sums = [dpo_sums(jnp.asarray(logps[r]), jnp.asarray(ref_logps[r]), beta, jnp.asarray(weights[4 * h:4 * h + 4]))
            for h, r in enumerate(halves)]
    count = float(sums[0][1] + sums[1][1])
    assert count == weights.sum()
    for name in ("loss", *METRICS):
        np.testing.assert_allclose((float(sums[0][0][name]) + float(sums[1][0][name])) / count, want[name],
                                   rtol=1e-6, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("beta", [1e-3, 0.1, 1.0, 37.0, 1e4])
def test_the_loss_is_exactly_ln_2_while_the_policy_is_the_reference(beta):
    """Both rewards exactly 0, so each pair's loss is softplus(0) = float32(ln 2) exactly, and so is
    the mean of a few pairs (float32 sums up to 12 copies of float32(ln 2) exactly)."""
    logps = jnp.asarray(_pairs_logps(np.random.default_rng(1), 5)[0])
    terms = dpo_terms(logps, logps, beta)
    np.testing.assert_array_equal(terms["loss"], np.full(5, LN2))
    np.testing.assert_array_equal(terms["chosen"], np.zeros(5, np.float32))
    np.testing.assert_array_equal(terms["rejected"], np.zeros(5, np.float32))
    loss, metrics = dpo_metrics(logps, logps, beta)
    assert np.float32(loss) == LN2
    assert float(metrics["rewards/accuracies"]) == 0.0 and float(metrics["rewards/margins"]) == 0.0


def test_large_margins_give_a_finite_loss_and_gradient():
    """Margins of +-1e4 nats: the loss is softplus(-margin), 0 and 1e4 (where -log(sigmoid(-1e4))
    would be -log(0) = inf), and its gradient the formula's, `-beta sigmoid(-margin) / B` w.r.t. the
    chosen answer's log-probability (the opposite w.r.t. the rejected one's), finite."""
    beta = 1.0
    logps = jnp.asarray([0.0, -1e4, -1e4, 0.0], jnp.float32)  # pair 0: chosen 1e4 nats above; pair 1: below
    ref_logps = jnp.zeros(4, jnp.float32)
    np.testing.assert_array_equal(dpo_terms(logps, ref_logps, beta)["loss"], np.array([0.0, 1e4], np.float32))

    def mean_loss(logps):
        return dpo_metrics(logps, ref_logps, beta)[0]

    loss, grad = jax.value_and_grad(mean_loss)(logps)
    assert float(loss) == 5e3
    margins = np.array([1e4, -1e4])
    slope = -beta * np.exp(-np.logaddexp(0.0, margins)) / 2  # d loss / d log pi(chosen): -beta sigmoid(-m) / B
    np.testing.assert_allclose(grad, np.concatenate([slope, -slope]), rtol=1e-6, atol=0)


def test_sequence_logps_is_the_sum_of_the_whole_logits_log_probabilities_of_its_targets():
    """Each row's sum of `log_softmax(logits)[target]` over its scored positions (the whole
    logits of `Decoder.apply`), at 2e-6 relative: the same per-position math from the hidden
    states a chunk at a time, only the sums' order differs."""
    params = init_params(SMALL)
    model = Decoder(SMALL)
    rng = np.random.default_rng(2)
    tokens = rng.integers(0, SMALL.vocab_size, (4, 12)).astype(np.int32)
    targets = rng.integers(0, SMALL.vocab_size, (4, 12)).astype(np.int32)
    targets[:, :3] = IGNORE  # a prompt's positions
    targets[1, 8:] = IGNORE  # padding after a shorter row
    targets[3, :] = IGNORE  # a row that scores nothing: 0
    got = sequence_logps(model, {"params": params}, jnp.asarray(tokens), jnp.asarray(targets))
    logits, _ = jit_apply(model, {"params": params}, jnp.asarray(tokens))  # [4, 12, V]
    log_p = np.asarray(jax.nn.log_softmax(logits, axis=-1), np.float64)
    keep = targets != IGNORE
    per_token = np.where(keep, np.take_along_axis(log_p, np.where(keep, targets, 0)[..., None], -1)[..., 0], 0.0)
    assert got.dtype == jnp.float32 and got.shape == (4,)
    np.testing.assert_allclose(got, per_token.sum(-1), rtol=2e-6, atol=2e-6)
    assert float(got[3]) == 0.0 and np.all(np.asarray(got[:3]) < -1.0)


# Text pairs of several lengths (padded apart in a batch): a prompt whose last token the answer
# merges with (" m" + "at." is " mat."), an answer that ends with the EOS token already, a pair
# whose answers are the same (a tie, no accuracy), Chinese.
PAIRS = [{"prompt": "The cat sat on the m", "chosen": "at.", "rejected": "og, and the dog sat on the log."},
         {"prompt": "Keys and values ", "chosen": "are cached.</s>", "rejected": "are not."},
         {"prompt": "Attention is all you need", "chosen": ".", "rejected": ". 注意力就是你所需要的一切。"},
         {"prompt": "今天天气很好，", "chosen": "我们去公园散步吧。", "rejected": "明天也许会下雨。"},
         {"prompt": "The dog sat", "chosen": " on the log.", "rejected": " on the log."},
         {"prompt": "Machine learning needs data", "chosen": ", compute and patience.", "rejected": "."}]


@pytest.fixture(scope="module")
def policy_and_reference(tmp_path_factory) -> tuple[Path, Path]:
    """Two random checkpoint folders of one shape and tokenizer, other weights."""
    root = tmp_path_factory.mktemp("dpo")
    for name, seed in (("policy", 0), ("reference", 1)):
        save_random_checkpoint(root / name, seed=seed)
    return root / "policy", root / "reference"


def _chosen_then_rejected(pairs, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """`tokens`, `targets` `[2 len(pairs), seq_len]`: every chosen row, then every rejected row, as
    TRL batches them."""
    both = rows([example for pair in pairs for example in pair.examples()], seq_len)  # chosen, rejected, ...
    return tuple(np.concatenate([both[name][0::2], both[name][1::2]]) for name in ("tokens", "targets"))


@pytest.mark.peers
@pytest.mark.parametrize("beta", [0.1, 1.0])
def test_the_loss_and_reward_metrics_are_trls(policy_and_reference, beta, tmp_path):
    """TRL's DPOTrainer (policy and reference models of their own, transformers') computes the loss
    of one batch of `PAIRS` and logs its metrics; `dpo_metrics` of `sequence_logps` under each of
    the two checkpoints jaxformer loads gives them within float32's error. Each sequence's
    log-probability sums up to ~40 per-token terms of a few nats (|sum| <= 130); torch and XLA sum
    them in other orders, a few ulps (ulp(128) = 7.6e-6) apart: rtol 1e-5. The rewards are beta
    times differences of two such sums and the loss softplus (slope < 1) of their margin: at these
    betas (<= 1) within 1e-5 too (measured: 2e-6 at most, at beta 1)."""
    torch = torch_peer()
    transformers = import_peer("transformers")
    policy_dir, reference_dir = policy_and_reference
    models = [transformers.AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32)
              for d in (policy_dir, reference_dir)]
    trainer = trl_dpo_trainer(tmp_path, models[0], transformers.AutoTokenizer.from_pretrained(str(policy_dir)),
                              PAIRS, ref_model=models[1], beta=beta)
    loss, metrics = trl_dpo_metrics(trainer, trainer.train_dataset)

    pairs = [pair_of(load_tokenizer(str(policy_dir)), record) for record in PAIRS]
    assert [[pair.prompt, pair.chosen, pair.rejected] for pair in pairs] == \
        [[row["prompt_ids"], row["chosen_ids"], row["rejected_ids"]] for row in trainer.train_dataset]
    seq_len = max(len(pair.prompt) + max(len(pair.chosen), len(pair.rejected)) for pair in pairs) - 1  # none cut
    tokens, targets = (jnp.asarray(x) for x in _chosen_then_rejected(pairs, seq_len))
    logps = []
    for folder in (policy_dir, reference_dir):
        config, params = load_hf(str(folder))
        logps.append(jax.jit(functools.partial(sequence_logps, Decoder(config)))({"params": params}, tokens, targets))
    want_loss, want = dpo_metrics(*logps, beta)
    assert 0 < float(want["rewards/accuracies"]) < 1 and abs(float(want_loss) - LN2) > 1e-3  # the checks have teeth
    np.testing.assert_allclose(loss, float(want_loss), rtol=1e-5, atol=1e-5)
    for name in METRICS:
        np.testing.assert_allclose(metrics[name], float(want[name]), rtol=1e-5, atol=1e-5, err_msg=name)
