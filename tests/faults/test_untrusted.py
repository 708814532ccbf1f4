"""The fault matrix, untrusted files: what a hostile but realistic checkpoint folder (or prompt) holds.

A checkpoint folder is someone else's data. Its chat template is code; its config.json
sizes tables; its shard index names files; and a prompt that fits `max_seq_len` may not
fit in memory. The rule: each is refused with one line that says what went wrong and
the limit, in bounded time and memory, and nothing saved changes.

Sections:
  Chat templates: `HOSTILE_TEMPLATES` (`test_a_hostile_template_is_refused_in_one_line`):
    a template that fails, loops, recurses or builds a huge value in one step or in
    many, each refused within the time limit; real templates render exactly as
    transformers' environment renders them; the time limit holds off the main thread;
    the command says it in one line, exit 2.
  Positions: a model whose `max_position_embeddings` is 10**8 or 10**12 loads, computes
    the logits of one with 64 positions, and the command decodes with it; the RoPE
    tables are rows of one another and their cache is bounded.
  Memory: a prefill that cannot fit is refused before anything compiles, by the API and
    by the command (naming the prompt length, what it needs and what is free); one that
    fits decodes, and XLA's own count of its memory stays below the estimate. The command
    under an address-space limit (`ulimit -v`, a process of its own) refuses a prompt past
    the limit or past max_seq_len in one line; an allocation that fails all the same ends
    it in one line too.
  Shards: an index entry outside the folder (absolute, `..`, a symlink) is refused, a
    stale extra shard changes nothing, a tensor missing from its shard is named; a
    Hugging Face cache snapshot (symlinks to its blobs) still loads.

Everything runs on one tiny decoder (vocab 280, d_model 16, one layer) and its byte-level
BPE tokenizer, written by jaxformer (no network, no torch); the commands run in-process
through `main(argv)`, but where a process's own limit is under test.
"""

import concurrent.futures
import contextlib
import dataclasses
import io
import json
import math
import os
import re
import resource
import shutil
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import count_compiles, init_params, random_params
from harness import REPO, snapshot
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from safetensors.numpy import load_file, save_file

from jaxformer import Decoder, DecoderConfig, KVCache, generate, stream
from jaxformer.commands import generate as cli
from jaxformer.convert import load_hf, save_hf
from jaxformer.decoding import DecodeRequest, start
from jaxformer.deltanet import GatedDeltaNetSpec
from jaxformer.feedforward import GatedMLPSpec
from jaxformer.latent_attention import LatentAttentionSpec
from jaxformer.layers import LayerSpec, layer_specs
from jaxformer.memory import format_bytes, free_bytes, prefill_bytes
from jaxformer.text import chat, render_chat, save_tokenizer, train_bpe
from jaxformer.text.sandbox import MAX_BUILT, MAX_INT_BITS, MAX_SIZE, MAX_TEMPLATE_CHARS

CORPUS = "\n".join(["The cat sat on the mat, and the dog sat on the log.",
                    "Keys and values are cached, so each new token costs one step."] * 20)
BPE = train_bpe([CORPUS], 280)  # no "~" in the corpus: "~" * n encodes to n tokens
TINY = DecoderConfig(vocab_size=BPE.vocab_size, n_layer=1, n_head=2, n_kv_head=1, d_model=16, max_seq_len=64)
HUGE = 10**12  # a max_position_embeddings no table can be sized by
MESSAGES = [{"role": "user", "content": "hi"}]
# The time limit the hostile templates render under (`render_chat(time_limit=)`): the bound
# works alike at any limit; the CLI's cases render under it as render_chat's default.
LIMIT = 1.0
FAST = 2.0  # seconds: a refusal that needs no waiting comes within this, with room for a loaded machine


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """The tiny decoder's checkpoint folder with its tokenizer, as jaxformer writes one."""
    path = tmp_path_factory.mktemp("checkpoint")
    save_hf(TINY, init_params(TINY), str(path), bos_id=BPE.bos_id, eos_id=BPE.eos_id, pad_id=BPE.pad_id)
    save_tokenizer(BPE, str(path))
    return path


@pytest.fixture(scope="module")
def huge_folder(tmp_path_factory) -> Path:
    """The same model, its config.json declaring `max_position_embeddings` 10**12."""
    path = tmp_path_factory.mktemp("huge")
    save_hf(TINY.replace(max_seq_len=HUGE), init_params(TINY), str(path), bos_id=BPE.bos_id, eos_id=BPE.eos_id,
            pad_id=BPE.pad_id)
    save_tokenizer(BPE, str(path))
    assert json.loads((path / "config.json").read_text())["max_position_embeddings"] == HUGE
    return path


def copy_of(folder: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy, symlinks=True)
    return copy


def run_command(argv: list[str]) -> tuple[int, str, list[str]]:
    """`jaxformer-generate argv` in this process: `(exit status, stdout, stderr lines)`."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            status = cli.main(argv, stdin=io.StringIO(""), stdout=out)
        except SystemExit as e:
            status = e.code
    return status, out.getvalue(), err.getvalue().splitlines()


def peak_rss_bytes() -> int:
    """The most memory this process has held (`ru_maxrss` counts KiB, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def assert_refused(status: int, out: str, err: list[str], message: str) -> None:
    """Exit 2, nothing on stdout, one line on stderr matching `message`."""
    assert status == 2 and out == "", (status, out, err)
    assert len(err) == 1 and err[0].startswith(f"{cli.PROG}: error: "), err
    assert re.search(message, err[0]), err[0]


# ---------------------------------------------------------------------------------------
# Chat templates
# ---------------------------------------------------------------------------------------

BIG = "{% set big = 'x' * 4000000 %}"  # a value within MAX_SIZE, built once
ONE_STEP = rf"builds a value of [\d,]+ characters \(or items\) in one step, past the limit of {MAX_SIZE:,}"
# Bytes a refused template may allocate: up to MAX_BUILT one-byte characters, kept in a list
# until their sum passes it, and a little more. Without the check that stops it, each case
# below would allocate more (120 MB, often gigabytes).
PEAK = MAX_BUILT + 16 * 2**20
# (id, template, what the one line says, whether it is the time limit that stops it)
HOSTILE_TEMPLATES = [
    ("division-by-zero", "{{ 1/0 }}", "fails: ZeroDivisionError: division by zero", False),
    ("range-past-the-sandbox-cap", "{% for i in range(10**9) %}{% endfor %}", "fails: OverflowError: Range too big",
     False),
    ("recursion", "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "fails: RecursionError: maximum recursion",
     False),
    ("undefined", "{{ tools.name }}", "fails: UndefinedError: 'tools' is undefined", False),
    ("unsafe-attribute", "{{ ''.__class__.__mro__ }}", "fails: SecurityError: access to attribute '__class__'", False),
    ("mutation", "{{ messages.append(1) }}", "fails: SecurityError: access to attribute 'append'", False),
    ("type-error", "{{ 'a' + 1 }}", "fails: TypeError: can only concatenate str", False),
    ("syntax", "{% for m in messages %}", "does not parse: line 1: Unexpected end of template", False),
    ("raise-exception", "{{ raise_exception('roles must\nalternate') }}",
     "refuses this conversation: roles must alternate$", False),
    ("nested-loops", "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
     rf"ran past its time limit of {LIMIT:g} s", True),
    ("a-python-loop-in-a-global", "{{ lipsum(10**6) }}", rf"ran past its time limit of {LIMIT:g} s", True),
    ("string-repeated", "{{ 'x' * 10**8 }}", ONE_STEP, False),
    ("list-repeated", "{{ [0] * 2 * 10**7 }}", ONE_STEP, False),
    ("power", "{{ 10 ** (10 ** 10) }}",
     rf"builds an int of [\d,]+ bits in one step, past the limit of {MAX_INT_BITS:,}", False),
    # (Jinja's ** groups from the left: `10 ** 10 ** 10` is (10 ** 10) ** 10, a 333-bit int.)
    ("power-of-a-power", "{{ 10 ** 10 ** 10000 }}", "builds an int of 330,001 bits", False),
    ("percent-width", "{{ '%100000000d' % 1 }}", ONE_STEP, False),
    ("center-method", "{{ 'x'.center(10**8) }}", ONE_STEP, False),
    ("ljust-method", "{{ 'x'.ljust(10**8) }}", ONE_STEP, False),
    ("zfill-method", "{{ '1'.zfill(10**8) }}", ONE_STEP, False),
    ("format-width", "{{ '{:>100000000}'.format(1) }}", ONE_STEP, False),
    ("format-width-argument", "{{ '{:{}}'.format(1, 10**8) }}", ONE_STEP, False),
    ("format-fields", BIG + "{{ ('{0}' * 30).format(big) }}", ONE_STEP, False),
    ("expandtabs", "{{ ('\t' * 100).expandtabs(10**6) }}", ONE_STEP, False),
    ("replace-method", BIG + "{{ ('x' * 100).replace('x', big) }}", ONE_STEP, False),
    ("join-method", BIG + "{{ ','.join([big] * 30) }}", ONE_STEP, False),
    ("to-bytes", "{{ (1).to_bytes(10**8, 'big') }}", ONE_STEP, False),
    ("center-filter", "{{ 'x' | center(100000000) }}", ONE_STEP, False),
    ("indent-filter", "{{ 'a\nb\nc' | indent(10**8) }}", ONE_STEP, False),
    ("format-filter", "{{ '%100000000d' | format(1) }}", ONE_STEP, False),
    ("replace-filter", BIG + "{{ ('x' * 100) | replace('x', big) }}", ONE_STEP, False),
    ("join-filter", "{% set comma = ',' * 1000000 %}{{ (['a'] * 200) | join(comma) }}", ONE_STEP, False),
    ("wordwrap-filter", "{{ ('a ' * 30) | wordwrap(1, wrapstring='y' * 4000000) }}", ONE_STEP, False),
    ("tojson-indent", "{{ [[[[[[[[[[[['x']]]]]]]]]]]] | tojson(indent=10**6) }}", ONE_STEP, False),
    ("slice-filter", "{{ [1] | slice(10**7) | list }}", ONE_STEP, False),
    ("a-list-printed", BIG + "{{ [big] * 30 }}", ONE_STEP, False),
    ("a-list-as-text", BIG + "{{ ([big] * 30) | upper }}", ONE_STEP, False),
    # Constant expressions are left to the rendering: compiling would build them out of bounds.
    ("constants-in-a-set", "{% set s = " + " ~ ".join(["('x' | center(4000000))"] * 15) + " %}", ONE_STEP, False),
    ("constants-printed", "{{ " + " ~ ".join(["('x' | center(4000000))"] * 15) + " }}", ONE_STEP, False),
    ("tilde-doubling", ("{% set ns = namespace(s='x') %}{% for i in range(30) %}{% set ns.s = ns.s ~ ns.s %}"
                        "{% endfor %}"), ONE_STEP, False),
    ("plus-doubling", ("{% set ns = namespace(s='x') %}{% for i in range(30) %}{% set ns.s = ns.s + ns.s %}"
                       "{% endfor %}"), ONE_STEP, False),
    ("output", "{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}",
     f"renders more than {MAX_SIZE:,} characters, past its limit", False),
    ("a-block-output", BIG + "{% set s %}{% for i in range(30) %}{{ big }}{% endfor %}{% endset %}",
     f"renders more than {MAX_SIZE:,} characters", False),
    ("many-large-values",
     BIG + "{% set ns = namespace(kept=[]) %}{% for i in range(40) %}{% set ns.kept = ns.kept + [big ~ i] %}"
     "{% endfor %}",
     f"builds more than {MAX_BUILT:,} characters \\(or items\\) in all, past its limit", False),
    ("too-long", "{# #}" + " " * MAX_TEMPLATE_CHARS,
     f"is {MAX_TEMPLATE_CHARS + 5:,} characters long, past the limit of {MAX_TEMPLATE_CHARS:,}", False),
]
TEMPLATES = {case[0]: case[1] for case in HOSTILE_TEMPLATES}


def _with_template(template: str):
    return dataclasses.replace(BPE, chat_template=template)


@pytest.mark.parametrize("template, message, waits", [case[1:] for case in HOSTILE_TEMPLATES],
                         ids=[case[0] for case in HOSTILE_TEMPLATES])
def test_a_hostile_template_is_refused_in_one_line(template, message, waits):
    tracer = sys.gettrace()  # None, or a debugger's or coverage's
    tracemalloc.start()  # Python's own count of what the rendering allocates
    try:
        started = time.perf_counter()
        with pytest.raises(ValueError) as refused:
            render_chat(_with_template(template), MESSAGES, time_limit=LIMIT)
        elapsed, (_, peak) = time.perf_counter() - started, tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    line = str(refused.value)
    assert "\n" not in line and line.startswith("the chat template "), line
    assert re.search(message, line), line
    # A hang would take hours: a refusal comes at the limit (the time limit), or at once,
    # before the step that would build the value.
    assert elapsed < (LIMIT + FAST if waits else FAST), f"{elapsed:.2f} s"
    assert peak < PEAK, format_bytes(peak)
    assert sys.gettrace() is tracer  # the time limit's trace function is gone


def test_the_time_limit_holds_in_a_worker_thread():
    """A server renders in its worker threads, where no signal can stop a template."""
    def render() -> float:
        started = time.perf_counter()
        with pytest.raises(ValueError, match="ran past its time limit"):
            render_chat(_with_template(TEMPLATES["nested-loops"]), MESSAGES, time_limit=LIMIT)
        return time.perf_counter() - started

    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        assert pool.submit(render).result(timeout=60) < LIMIT + FAST


# Real templates, as chat checkpoints ship them, using every path the bounds watch
# (`+ * %`, `~`, methods, filters, blocks, macros, loop controls) within their limits.
LLAMA3 = """{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Today Date: " + strftime_now("%Y") + "\\n\\n" }}
{%- if tools is defined %}{{- tools | tojson(indent=4) }}{%- endif %}{{- {'k': '注意'} | tojson(indent=4) }}
{{- system_message }}{{- "<|eot_id|>" }}
{%- for message in messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}
    {{- message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}
"""
QWEN_LIKE = """{%- macro render(m) -%}<|im_start|>{{ m.role }}
{{ m.content.split('</think>')[-1].lstrip('\\n') }}<|im_end|>
{% endmacro -%}
{%- set ns = namespace(last_user=messages | length - 1, seen=[]) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages | length - 1) - loop.index0 %}
    {%- if message.role == 'user' %}{% set ns.last_user = index %}{% break %}{% endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.role == 'system' and not loop.first %}{% continue %}{% endif %}
    {%- set ns.seen = ns.seen + [message.role] %}
    {{- render(message) }}
    {%- if loop.index0 == ns.last_user %}{{ '%s user turns, %d seen' % (loop.index, ns.seen | length) }}
{% endif %}
{%- endfor %}
{%- set rule %}{{ '=' * 8 }}{{ 'end' | center(12) }}{% endset %}
{{- rule ~ '\\n' ~ ('{:>6}|{:<6}'.format('a', 'b')) ~ (['x', 'y'] | join(', ')) ~ ('a\\nb' | indent(2)) }}
{{- messages | map(attribute='role') | unique | list | tojson }}{{ 'tab\\tbed'.expandtabs(4) | replace('b', 'B') }}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}
"""


def _transformers_environment():
    """Jinja's sandbox as transformers' `apply_chat_template` configures it for these
    templates (its options and helpers), without bounds."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = chat._tojson
    env.globals.update(raise_exception=chat._raise_exception, strftime_now=lambda fmt: time.strftime(fmt))
    return env


@pytest.mark.parametrize("template", [LLAMA3, QWEN_LIKE], ids=["llama3", "qwen-like"])
def test_real_templates_render_as_transformers_environment_does(template):
    """A long conversation too (2,000 turns, 300,000 characters): real templates stay far
    inside the limits."""
    turns = [{"role": "system", "content": " Be brief. "}] + [
        {"role": ("user", "assistant")[i % 2], "content": f"<think>hm</think>\nmessage {i}, {'é注' * 40}"}
        for i in range(2000)]
    tokenizer = _with_template(template)
    want = _transformers_environment().from_string(template).render(
        messages=turns, add_generation_prompt=True, **tokenizer.special_tokens)
    assert render_chat(tokenizer, turns) == want and len(want) > 100_000


@pytest.mark.parametrize("case, message", [
    ("division-by-zero", "the chat template fails: ZeroDivisionError"),
    ("nested-loops", f"the chat template ran past its time limit of {LIMIT:g} s"),
    ("string-repeated", "the chat template builds a value of 100,000,000 characters"),
])
def test_cli_refuses_a_hostile_template_in_one_line(folder, tmp_path, monkeypatch, case, message):
    """The command renders under `render_chat`'s default time limit, here `LIMIT` (the
    message names it) rather than the ten seconds a user waits."""
    monkeypatch.setitem(render_chat.__kwdefaults__, "time_limit", LIMIT)
    copy = copy_of(folder, tmp_path)
    (copy / "chat_template.jinja").write_text(TEMPLATES[case])
    before = snapshot(copy)
    status, out, err = run_command(["--checkpoint", str(copy), "--chat", "--prompt", "hi", "--max-new-tokens", "2"])
    assert_refused(status, out, err, rf"--chat: {re.escape(str(copy))}: {message}")
    assert snapshot(copy) == before


# ---------------------------------------------------------------------------------------
# Positions: max_position_embeddings sizes nothing
# ---------------------------------------------------------------------------------------

def test_the_program_holds_no_position_table():
    """RoPE's angles are computed in the program from the positions: a 128k-context model's
    program holds no constant larger than its `head_dim / 2` frequencies (a table of
    `[max_seq_len, head_dim/2]` cos and sin would be two 16 MB constants at head_dim 64)."""
    config = TINY.replace(max_seq_len=131072)
    model = Decoder(config)
    tokens = jnp.zeros((1, 8), jnp.int32)
    params = jax.eval_shape(lambda: model.init(jax.random.key(0), tokens))["params"]
    for args in ((tokens,), (tokens, KVCache.create(config, 1, 16))):
        program = jax.jit(model.apply).lower({"params": params}, *args).as_text()
        shapes = re.findall(r"stablehlo\.constant dense<.*?> : tensor<([\dx]+)xf32>", program)
        largest = max((math.prod(int(d) for d in shape.split("x")) for shape in shapes), default=0)
        assert 0 < largest <= config.head_dim // 2, (largest, config.head_dim)


@pytest.mark.parametrize("positions", [10**8, HUGE])
def test_a_model_declaring_huge_positions_computes_what_a_short_one_does(positions):
    """The same weights with max_seq_len 64 and 10**8 (or 10**12): the same logits, bit for
    bit, with and without a cache, in the time and memory of the small model."""
    params = init_params(TINY)
    tokens = jnp.asarray([BPE.encode("The cat sat on the mat")])  # [1, T]
    rss_before = peak_rss_bytes()
    started = time.perf_counter()
    logits = {}
    for config in (TINY, TINY.replace(max_seq_len=positions)):
        model = Decoder(config)
        cache = KVCache.create(config, 1, 16)
        logits[config.max_seq_len] = [jax.jit(model.apply)({"params": params}, tokens)[0],
                                      jax.jit(model.apply)({"params": params}, tokens, cache)[0]]
    for small, huge in zip(logits[64], logits[positions]):
        np.testing.assert_array_equal(small, huge)
    assert time.perf_counter() - started < 30
    assert peak_rss_bytes() - rss_before < 2**30  # (the old tables: 20 GB at 10**8, 3.6 TiB at 10**12)


def test_a_cache_sized_by_huge_positions_is_refused():
    """`KVCache.create(config, batch)` defaults to max_seq_len: refused, not allocated."""
    with pytest.raises(ValueError, match=r"KVCache.create: a cache of 1,000,000,000,000 positions .* needs about "
                                         r"[\d.,]+ TiB of memory, more than the .* free on "):
        KVCache.create(TINY.replace(max_seq_len=HUGE), 1)


def test_cli_decodes_with_a_checkpoint_declaring_huge_positions(huge_folder):
    before = snapshot(huge_folder)
    started = time.perf_counter()
    status, out, err = run_command(["--checkpoint", str(huge_folder), "--prompt", "The cat", "--max-new-tokens", "3",
                                    "--json"])
    assert status == 0, err
    row = json.loads(out)
    assert row["completion_tokens"] >= 1 and row["prompt_tokens"] == len(BPE.encode("The cat"))
    assert err[0].startswith("loaded") and "1 layer x 16" in err[0]
    assert time.perf_counter() - started < 60
    assert snapshot(huge_folder) == before


# ---------------------------------------------------------------------------------------
# Memory: a prefill that cannot fit
# ---------------------------------------------------------------------------------------

# Tokens: with dense attention the tiny model's prefill needs hundreds of GiB (the scores alone: 2 * T**2 * 4
# bytes); in blocks (what "auto" picks at this length) a few hundred MiB.
PAST_MEMORY = 200_000
REFUSED = (r"the prefill of a 200,000-token prompt \(1 row, a cache of [\d,]+ positions\) needs about [\d.,]+ [MTG]iB "
           r"of memory, more than the [\d.,]+ [KMGT]iB free on ")


@pytest.mark.parametrize("decode", [
    lambda model, params, prompt: generate(model, params, prompt, max_new_tokens=4),
    lambda model, params, prompt: next(stream(model, params, prompt, max_new_tokens=4)),
], ids=["generate", "stream"])
def test_a_prefill_past_memory_is_refused_before_compiling(decode):
    model, params = Decoder(TINY.replace(max_seq_len=HUGE, attention_impl="dense")), init_params(TINY)
    prompt = np.ones((1, PAST_MEMORY), np.int32)
    started = time.perf_counter()
    with count_compiles() as compiles, pytest.raises(ValueError, match=REFUSED):
        decode(model, params, prompt)
    assert compiles == [] and time.perf_counter() - started < FAST


def test_a_long_prompt_that_fits_decodes_and_xla_needs_no_more_than_the_estimate():
    """Thousands of tokens on the tiny model (a few hundred MiB) are not refused; XLA's own
    count of the prefill's buffers is within the estimate, and not far below it."""
    config = TINY.replace(max_seq_len=HUGE)
    model, params = Decoder(config), init_params(TINY)
    prompt = (np.arange(3000, dtype=np.int32) % TINY.vocab_size)[None]  # [1, 3000]
    out = np.asarray(generate(model, params, prompt, max_new_tokens=4))
    assert out.shape == (1, 3004) and np.all((out[:, 3000:] >= 0) & (out[:, 3000:] < TINY.vocab_size))
    request = DecodeRequest.create(model, prompt, max_new_tokens=4)
    memory = start.lower(model, params, request).compile().memory_analysis()
    xla = memory.temp_size_in_bytes + memory.output_size_in_bytes
    estimate = prefill_bytes(config, 1, 3000, 3003)
    assert xla <= estimate <= 2 * xla, (format_bytes(xla), format_bytes(estimate))


# The new mixers' prefills, each layer's own term: Gated DeltaNet layers (chunks of 64: their [C, C] arrays and
# per-position arrays, linear in T), latent attention over its latent cache (8 heads of a 64-wide latent, more
# than the config's 4), dense and in blocks.
_PLAIN = DecoderConfig(vocab_size=64, n_layer=2, n_head=4, n_kv_head=2, d_model=64, max_seq_len=HUGE, d_ff=64)
_LINEAR = dataclasses.replace(layer_specs(_PLAIN)[0], mixer=GatedDeltaNetSpec(2, 8, 32, 32, chunk=64))
_LATENT = LayerSpec(LatentAttentionSpec(n_head=8, q_lora_rank=32, kv_lora_rank=64, qk_nope_head_dim=32,
                                        qk_rope_head_dim=16, v_head_dim=32, rope_theta=1e4, rope_scaling=None,
                                        rope_pairing="split_half"), GatedMLPSpec(64))
NEW_MIXERS = {"linear": (_PLAIN.replace(layers=(_LINEAR,) * 2), 3000),
              "latent-dense": (_PLAIN.replace(layers=(_LATENT,) * 2, attention_impl="dense"), 1500),
              "latent-blocks": (_PLAIN.replace(layers=(_LATENT,) * 2), 3000)}


@pytest.mark.parametrize("name", sorted(NEW_MIXERS))
def test_xla_needs_no_more_than_the_estimate_for_the_new_mixers(name):
    """XLA's own count of the prefill's buffers is within `prefill_bytes`, and not far below it."""
    config, length = NEW_MIXERS[name]
    model = Decoder(config)
    request = DecodeRequest.create(model, np.ones((1, length), np.int32), max_new_tokens=4)
    memory = start.lower(model, random_params(config, seed=0), request).compile().memory_analysis()
    xla = memory.temp_size_in_bytes + memory.output_size_in_bytes
    estimate = prefill_bytes(config, 1, length, length + 3)
    assert xla <= estimate <= 2 * xla, (format_bytes(xla), format_bytes(estimate))


def test_the_check_compares_with_the_memory_free(monkeypatch):
    """What fits depends on what is free: the same prompt is refused when little is (once
    it is past the size too small to look: `UNCHECKED_BYTES`)."""
    model, params = Decoder(TINY), init_params(TINY)
    prompt = np.ones((2, 40), np.int32)
    generate(model, params, prompt, max_new_tokens=4)  # fits
    monkeypatch.setattr("jaxformer.memory.free_bytes", lambda: (2**10, "the test's device"))
    generate(model, params, prompt, max_new_tokens=4)  # a few KiB: not looked at
    monkeypatch.setattr("jaxformer.memory.UNCHECKED_BYTES", 0)
    with pytest.raises(ValueError, match=r"40-token prompt \(2 rows, a cache of 43 positions\) needs about [\d.]+ "
                                         r"KiB of memory, more than the 1.0 KiB free on the test's device"):
        generate(model, params, prompt, max_new_tokens=4)


def test_free_memory_of_accelerators_is_their_limit_less_their_use(monkeypatch):
    class Device:  # what jax.Device.memory_stats() reports on a GPU
        platform = "gpu"

        def __init__(self, limit, in_use):
            self.stats = {"bytes_limit": limit, "bytes_in_use": in_use}

        def memory_stats(self):
            return self.stats

    assert free_bytes()[0] > 0  # this host: its available memory
    monkeypatch.setattr(jax, "local_devices", lambda: [Device(80 * 2**30, 30 * 2**30), Device(80 * 2**30, 0)])
    assert free_bytes() == (130 * 2**30, "2 GPU devices")


def test_a_prefill_in_blocks_needs_memory_linear_in_the_prompt():
    """The same 200,000 tokens attending in blocks: about 1.5 KiB a token, not 2 * T * 4 bytes a token."""
    config = TINY.replace(max_seq_len=HUGE)
    blocks = [prefill_bytes(config, 1, T, T + 4) for T in (PAST_MEMORY // 2, PAST_MEMORY)]
    assert blocks[1] < 2**30 and 1.9 < blocks[1] / blocks[0] < 2.1
    assert prefill_bytes(config.replace(attention_impl="dense"), 1, PAST_MEMORY, PAST_MEMORY + 4) > 100 * 2**30


def test_cli_refuses_a_prompt_past_memory_in_one_line_before_compiling(huge_folder, tmp_path, monkeypatch):
    """The host said to have 64 MiB free: the 200,000-token prompt's prefill, in blocks, needs more."""
    monkeypatch.setattr("jaxformer.memory.free_bytes", lambda: (64 * 2**20, "the host"))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("~" * PAST_MEMORY + "\n")
    before = snapshot(huge_folder)
    started = time.perf_counter()
    with count_compiles() as compiles:
        status, out, err = run_command(["--checkpoint", str(huge_folder), "--prompts-file", str(prompts),
                                        "--max-new-tokens", "2"])
    assert_refused(status, out, err, REFUSED + "the host$")
    assert compiles == [] and time.perf_counter() - started < 10 * FAST  # (tokenizing 200,000 characters included)
    assert snapshot(huge_folder) == before


# The address-space limit (`ulimit -v`, in KiB) the command runs under, and a SwiGLU so wide that
# a 60,000-token prompt's prefill needs more than it (3 * T * WIDE * 4 bytes, about 17 GiB), while
# the weights stay a few MiB.
ADDRESS_SPACE_KIB = 16_000_000
WIDE = 25_000
LONG_PROMPT = "~" * 60_000


@pytest.fixture(scope="module")
def wide_folder(tmp_path_factory) -> Path:
    """The tiny model with a SwiGLU of width `WIDE` and a context of 10**12 positions."""
    path = tmp_path_factory.mktemp("wide")
    save_hf(TINY.replace(max_seq_len=HUGE, d_ff=WIDE), init_params(TINY.replace(d_ff=WIDE)), str(path),
            bos_id=BPE.bos_id, eos_id=BPE.eos_id, pad_id=BPE.pad_id)
    save_tokenizer(BPE, str(path))
    return path


@pytest.mark.parametrize("checkpoint, message", [
    ("folder", r"prompt 1 \('~~~.*'\.\.\.\) is 6000\d tokens: with --max-new-tokens 128 that passes max_seq_len 64$"),
    ("wide_folder", r"the prefill of a 60,00\d-token prompt \(1 row, a cache of [\d,]+ positions\) needs about "
                    r"[\d.]+ GiB of memory, more than the [\d.]+ GiB free on the host( within this process's "
                    r"address-space limit \(ulimit -v: [\d.]+ GiB\))?$"),
])
def test_cli_under_an_address_space_limit_refuses_a_long_prompt_in_one_line(checkpoint, message, request):
    """`ulimit -v 16000000; jaxformer-generate` with a 60,000-token prompt on standard input, in
    a process of its own: one line and exit 2, never a traceback, whether the prompt is past
    max_seq_len or its prefill past the limit, which the line names (unless the host has even
    less free: the host's memory is named then)."""
    folder = request.getfixturevalue(checkpoint)
    done = subprocess.run(["bash", "-c", f'ulimit -v {ADDRESS_SPACE_KIB} && exec "$@"', "bash", sys.executable, "-m",
                           "jaxformer.commands.generate", "--checkpoint", str(folder)],
                          input=LONG_PROMPT, capture_output=True, text=True, cwd=REPO, timeout=180)
    err = done.stderr.splitlines()
    assert done.returncode == 2 and done.stdout == "" and len(err) == 1, done.stderr[-3000:]
    assert err[0].startswith(f"{cli.PROG}: error: ") and re.search(message, err[0]), err[0]


def test_cli_ends_an_allocation_that_fails_all_the_same_in_one_line(folder, monkeypatch):
    """XLA's RESOURCE_EXHAUSTED past the estimate (its margin, work it does not count): one line
    naming what is free, exit 1, no traceback."""
    def exhausted(*args, **kwargs):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 24079285768 bytes.")

    monkeypatch.setattr(cli, "start", exhausted)
    monkeypatch.setattr("jaxformer.commands.generate.free_bytes", lambda: (13 * 2**30, "the test's host"))
    status, out, err = run_command(["--checkpoint", str(folder), "--prompt", "The cat", "--max-new-tokens", "4"])
    assert status == 1 and out == "" and err == [
        f"{cli.PROG}: error: out of memory: RESOURCE_EXHAUSTED: Out of memory allocating 24079285768 bytes (13.0 GiB "
        "free on the test's host): a shorter prompt, fewer prompts at once or --dtype bfloat16 needs less"], err


# ---------------------------------------------------------------------------------------
# Shards: the index names files inside the folder, and each tensor's file
# ---------------------------------------------------------------------------------------

INDEX = "model.safetensors.index.json"


def shard(folder: Path, files: dict[str, list[str]] | None = None, weight_map: dict[str, str] | None = None) -> dict:
    """The folder's single file split into shards (`files`: file -> its tensors; default:
    two halves), and an index naming `weight_map` (default: where each tensor went)."""
    tensors = load_file(str(folder / "model.safetensors"))
    os.remove(folder / "model.safetensors")
    names = sorted(tensors)
    files = files or {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for name, keys in files.items():
        save_file({k: tensors[k] for k in keys}, str(folder / name), metadata={"format": "pt"})
    weight_map = weight_map or {k: name for name, keys in files.items() for k in keys}
    (folder / INDEX).write_text(json.dumps({"weight_map": weight_map}))
    return tensors


def point(folder: Path, key: str, file: str) -> None:
    """Makes the index put tensor `key` in `file`."""
    index = json.loads((folder / INDEX).read_text())
    index["weight_map"][key] = file
    (folder / INDEX).write_text(json.dumps(index))


def outside(folder: Path) -> Path:
    """A valid shard outside the checkpoint folder, next to it."""
    file = folder.parent / "elsewhere" / "model-00001-of-00002.safetensors"
    file.parent.mkdir(exist_ok=True)
    shutil.copy(folder / "model-00001-of-00002.safetensors", file)
    return file


def absolute_entry(folder: Path) -> None:
    shard(folder)
    point(folder, "model.norm.weight", str(outside(folder)))


def dotdot_entry(folder: Path) -> None:
    shard(folder)
    point(folder, "model.norm.weight", "../elsewhere/" + outside(folder).name)


def symlinked_shard(folder: Path) -> None:
    shard(folder)
    target = outside(folder)
    os.remove(folder / target.name)
    os.symlink(target, folder / target.name)


def symlinked_single_file(folder: Path) -> None:
    target = folder.parent / "elsewhere.safetensors"
    shutil.move(folder / "model.safetensors", target)
    os.symlink(target, folder / "model.safetensors")


def missing_from_its_shard(folder: Path) -> None:
    shard(folder)
    index = json.loads((folder / INDEX).read_text())
    key = next(k for k, f in index["weight_map"].items() if f.startswith("model-00001"))
    point(folder, key, "model-00002-of-00002.safetensors")


SHARD_REFUSALS = [
    pytest.param(absolute_entry, (r"model\.safetensors\.index\.json: weight_map entry 'model\.norm\.weight': "
                                  r"'/.*elsewhere/model-00001-of-00002\.safetensors' is not a file inside the "
                                  r"checkpoint folder \(an absolute path"), id="absolute"),
    pytest.param(dotdot_entry, r"model\.safetensors\.index\.json: weight_map entry 'model\.norm\.weight': "
                               r"'\.\./elsewhere/model-00001-of-00002\.safetensors' is not a file inside", id="dotdot"),
    pytest.param(symlinked_shard, r"model\.safetensors\.index\.json: weight_map entry '.*': "
                                  r"'model-00001-of-00002\.safetensors' resolves to .*elsewhere.*, outside ",
                 id="symlink-out"),
    pytest.param(symlinked_single_file, r"model\.safetensors: 'model\.safetensors' resolves to .*elsewhere"
                                        r"\.safetensors, outside ", id="single-file-symlink-out"),
    pytest.param(missing_from_its_shard, r"model\.safetensors\.index\.json: weight_map puts '[^']+' in "
                                         r"model-00002-of-00002\.safetensors, but .*model-00002-of-00002\.safetensors "
                                         r"does not hold it", id="missing-from-its-shard"),
]


@pytest.mark.parametrize("damage, message", SHARD_REFUSALS)
def test_load_hf_refuses_a_shard_outside_or_without_its_tensor(folder, tmp_path, damage, message):
    copy = copy_of(folder, tmp_path)
    damage(copy)
    before = snapshot(tmp_path)
    with pytest.raises(ValueError, match=message) as refused:
        load_hf(str(copy))
    assert "\n" not in str(refused.value) and str(copy) in str(refused.value)
    assert snapshot(tmp_path) == before


def test_a_stale_extra_shard_does_not_override_the_weight_map(folder, tmp_path):
    """A shard the index lists for one tensor also holds an old copy of another, which
    the index puts elsewhere: only the index's tensor is read (the stale file's name
    sorts last, where reading every file in turn would let it win)."""
    copy = copy_of(folder, tmp_path)
    tensors = shard(copy)
    listed = "model.layers.0.input_layernorm.weight"
    save_file({listed: tensors[listed], "model.norm.weight": tensors["model.norm.weight"] + 1},
              str(copy / "zz-stale.safetensors"))
    point(copy, listed, "zz-stale.safetensors")
    _, params = load_hf(str(copy))
    jax.tree.map(np.testing.assert_array_equal, params, init_params(TINY))


def test_a_hub_cache_snapshot_with_symlinks_to_its_blobs_loads(folder, tmp_path):
    """`models--org--name/snapshots/<revision>/*` are symlinks to `../../blobs/<hash>`:
    outside the snapshot folder, inside the repository's."""
    repository = tmp_path / "models--org--tiny"
    snapshot_folder = repository / "snapshots" / "0123abc"
    (repository / "blobs").mkdir(parents=True)
    snapshot_folder.mkdir(parents=True)
    staged = copy_of(folder, tmp_path)
    shard(staged)
    for file in staged.iterdir():
        blob = repository / "blobs" / f"blob-{file.name}"
        shutil.move(file, blob)
        os.symlink(os.path.join("..", "..", "blobs", blob.name), snapshot_folder / file.name)
    _, params = load_hf(str(snapshot_folder))
    jax.tree.map(np.testing.assert_array_equal, params, init_params(TINY))


def test_cli_refuses_a_shard_outside_the_folder_in_one_line(folder, tmp_path):
    copy = copy_of(folder, tmp_path)
    absolute_entry(copy)
    before = snapshot(tmp_path)
    status, out, err = run_command(["--checkpoint", str(copy), "--prompt", "hi", "--max-new-tokens", "2"])
    assert_refused(status, out, err, r"weight_map entry 'model\.norm\.weight': .* is not a file inside the checkpoint")
    assert snapshot(tmp_path) == before
