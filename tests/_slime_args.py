"""slime's argument checks that a command line using this plugin meets, restated for the tests.

What THUDM/slime 624b824 does with a command line, in our own words (slime cannot be installed here):

* Parsing (``get_slime_extra_args_provider`` in ``slime/utils/arguments.py``, through Megatron's parser with
  ``ignore_unknown_args=True``): the flags of :data:`FLAGS` with their kinds, choices and defaults. slime's
  parser *ignores* a flag it does not define; here an unknown flag is an error, since a documented flag that
  slime ignores does nothing.
* ``slime_validate_args`` (same file), in this order: ``--rollout-temperature`` > 0; ``--kl-coef`` and
  ``--kl-loss-coef`` not both non-zero; the ``reinforce_plus_plus*`` estimators need
  ``--normalize-advantages``; ``--use-rollout-logprobs`` excludes ``--use-tis``; ``--get-mismatch-metrics``
  needs ``--custom-tis-function-path``; ``--use-dynamic-batch-size`` needs ``--max-tokens-per-gpu``;
  the batch-size rule (``slime/utils/arguments.py`` lines 1971-1979 at 624b824): with ``--num-steps-per-rollout``
  set, ``global_batch_size = rollout_batch_size * n_samples_per_prompt // num_steps_per_rollout``; an explicit
  ``--global-batch-size`` of another value is an assertion error, none is set to that value (without
  ``--num-steps-per-rollout`` slime leaves ``--global-batch-size`` as given); ``--num-rollout`` or
  ``--num-epoch`` is required; then the ``--custom-config-path`` YAML keys are set on ``args`` (after every
  check above, so a YAML key never meets them).
* ``_validate_allgather_cp_supported`` (``slime/backends/megatron_utils/arguments.py``): ``--allgather-cp``
  with ``--context-parallel-size`` > 1 only for DSA-attention models (DeepSeek-V3.2, GLM-5.1).
* ``load_function`` (``slime/utils/misc.py``): a function path is ``module.attr``, imported when first used;
  here a ``slime_tis.`` path must resolve now.
* The run a documented block is added to: the batch flags of slime's own example scripts
  (:data:`EXAMPLE_SCRIPTS`); a block's flags come after the script's, and the last value of a flag wins (argparse).

Checked against slime 624b824's real parser (``add_slime_arguments`` on a plain ``argparse`` parser, plus
Megatron's ``--tensor-model-parallel-size`` / ``--context-parallel-size``) and real ``slime_validate_args`` (the
YAML written to a file; run outside CI, where slime cannot be installed): every flag of :data:`FLAGS` is slime's,
and the verdict is the same on each documented block added to each script of :data:`EXAMPLE_SCRIPTS` (96 of 96)
and on the refusals of ``test_the_stand_in_refuses_what_slime_refuses`` other than the three below. Only the
stand-in covers: an unknown flag (slime ignores it), a ``slime_tis.`` function path that does not resolve (slime
fails when it first loads it) and ``--allgather-cp`` at CP > 1 (slime's Megatron-side check, which that run
leaves out). Left out: slime's checks of what no plugin command line sets (paths on disk, OPD, evaluation,
colocation, offloading, sglang's arguments).
"""

from __future__ import annotations

import importlib
import shlex
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import yaml

__all__ = ["BASE", "EXAMPLE_SCRIPTS", "FLAGS", "SlimeArgsError", "command_tokens", "parse", "validate", "slime_accepts"]

#: the batch flags of slime 624b824's RL example scripts, one script per distinct setting (the others named after
#: it; the SFT scripts left out); slime requires ``--rollout-batch-size`` and one of ``--num-rollout`` / ``--num-epoch``
EXAMPLE_SCRIPTS = {
    # also run-glm4-9B, run-mimo-7B-rl-eagle, run-qwen3-30B-A3B, run-qwen3-32B (--num-rollout 5), run-qwen3-4B-amd,
    # run-qwen2.5-0.5B-reproducibility (100), low_precision/run-qwen3-{235B-A22B,30B-A3B}-int4, -4b-fp8
    "scripts/run-qwen3-4B.sh": "--num-rollout 3000 --rollout-batch-size 32 --n-samples-per-prompt 8 "
                               "--global-batch-size 256",
    "scripts/run-glm4.7-30B-A3B.sh": "--num-rollout 3000 --rollout-batch-size 128 --n-samples-per-prompt 8 "
                                     "--global-batch-size 1024",
    # also run-glm5-744B-A40B, run-glm5.2-744B-A40B, run-qwen3-next-80B-A3B, run-qwen3.5-27B
    "scripts/run-qwen3-235B-A22B.sh": "--num-rollout 3000 --rollout-batch-size 8 --n-samples-per-prompt 8 "
                                      "--global-batch-size 64",
    # also run-glm4.7-355B-A32B, run-minimax-m2, run-moonlight-16B-A3B, run-kimi-k2-{Instruct,Thinking} (100),
    # low_precision/run-kimi-k2-Thinking-int4, low_precision/run-moonlight-16B-A3B-int4
    "scripts/run-deepseek-r1.sh": "--num-rollout 3000 --rollout-batch-size 128 --n-samples-per-prompt 8 "
                                  "--num-steps-per-rollout 4",
    "scripts/run-qwen2.5-0.5B-gb10-smoke.sh": "--num-rollout 1 --rollout-batch-size 2 --n-samples-per-prompt 2 "
                                              "--num-steps-per-rollout 1 --global-batch-size 4",
    "scripts/low_precision/run-qwen3-30b-a3b-fp8.sh": "--num-rollout 200 --rollout-batch-size 16 "
                                                      "--n-samples-per-prompt 8 --global-batch-size 128",
}

#: the run the documented blocks name: scripts/run-qwen3-4B.sh's batch flags
BASE = EXAMPLE_SCRIPTS["scripts/run-qwen3-4B.sh"]

DSA_ARCHITECTURES = ("DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM")


@dataclass(frozen=True)
class Flag:
    dest: str
    kind: str  # "switch" (store_true), "str", "int", "float"
    default: Any = None
    choices: tuple[str, ...] | None = None


def _switch(name: str) -> tuple[str, Flag]:
    return name, Flag(name[2:].replace("-", "_"), "switch", False)


def _value(name: str, kind: str, default: Any = None, choices: tuple[str, ...] | None = None) -> tuple[str, Flag]:
    return name, Flag(name[2:].replace("-", "_"), kind, default, choices)


#: slime 624b824's flags (and the Megatron flags slime re-declares or reads) that a plugin command line can use
FLAGS: dict[str, Flag] = dict([
    # hooks
    _value("--custom-tis-function-path", "str"),
    _value("--custom-loss-function-path", "str"),
    _value("--rollout-data-postprocess-path", "str"),
    _value("--custom-megatron-before-train-step-hook-path", "str"),
    _value("--custom-pg-loss-reducer-function-path", "str"),
    _value("--custom-generate-function-path", "str"),
    _value("--custom-config-path", "str"),
    # algorithm
    _switch("--use-tis"),
    _switch("--use-rollout-logprobs"),
    _switch("--get-mismatch-metrics"),
    _value("--loss-type", "str", "policy_loss", ("policy_loss", "sft_loss", "custom_loss")),
    _value("--advantage-estimator", "str", "grpo",
           ("grpo", "gspo", "cispo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo")),
    _switch("--normalize-advantages"),
    _value("--eps-clip", "float", 0.2),
    _value("--eps-clip-high", "float"),
    _value("--eps-clip-c", "float"),
    _value("--kl-coef", "float", 0.0),
    _switch("--use-kl-loss"),
    _value("--kl-loss-coef", "float", 0.0),
    _value("--kl-loss-type", "str", "k1", ("k1", "k2", "k3", "low_var_kl")),
    _switch("--use-unbiased-kl"),
    _value("--entropy-coef", "float", 0.0),
    _value("--tis-clip", "float", 2.0),
    _value("--tis-clip-low", "float", 0.0),
    _switch("--use-opsm"),
    _value("--opsm-delta", "float", 1e-4),
    _switch("--use-routing-replay"),
    _switch("--use-rollout-routing-replay"),
    _switch("--calculate-per-token-loss"),
    _switch("--recompute-loss-function"),
    _value("--log-probs-chunk-size", "int", -1),
    # rollout and batching
    _value("--rollout-batch-size", "int"),
    _value("--n-samples-per-prompt", "int", 1),
    _value("--num-rollout", "int"),
    _value("--num-epoch", "int"),
    _value("--global-batch-size", "int"),
    _value("--num-steps-per-rollout", "int"),
    _value("--micro-batch-size", "int", 1),
    _switch("--use-dynamic-batch-size"),
    _value("--max-tokens-per-gpu", "int"),
    _value("--rollout-temperature", "float", 1.0),
    _value("--rollout-top-p", "float", 1.0),
    _value("--rollout-top-k", "int", -1),
    _value("--save-debug-train-data", "str"),
    _value("--hf-checkpoint", "str"),
    # parallelism (Megatron's)
    _value("--tensor-model-parallel-size", "int", 1),
    _value("--context-parallel-size", "int", 1),
    _switch("--allgather-cp"),
])


class SlimeArgsError(ValueError):
    """A command line slime 624b824 refuses (or, for an unknown flag, silently ignores)."""


def command_tokens(text: str) -> list[str]:
    """The ``--flag [value]`` tokens of a shell fragment: comments, line continuations, ``NAME=(`` / ``)`` array
    syntax and ``${...}`` expansions dropped (a run script's argument arrays become one command line)."""
    out: list[str] = []
    for line in text.replace("\\\n", " ").splitlines():
        for tok in shlex.split(line, comments=True):
            if tok in ("(", ")") or tok.endswith("=(") or tok.startswith("${") or tok.startswith("$"):
                continue
            out.append(tok)
    return out


def parse(tokens: list[str] | str, *, base: str = BASE) -> SimpleNamespace:
    """``args`` as slime's parser builds it from ``base`` + ``tokens``: defaults, then the flags. Raises
    :class:`SlimeArgsError` for a flag slime does not define, a missing or ill-typed value, a value outside
    the flag's choices. Tokens that are not flags or their values (shell words) are skipped."""
    toks = command_tokens(base) + (command_tokens(tokens) if isinstance(tokens, str) else list(tokens))
    ns = SimpleNamespace(**{f.dest: f.default for f in FLAGS.values()})
    i = 0
    while i < len(toks):
        tok = toks[i]
        i += 1
        if not tok.startswith("--"):
            continue
        name, eq, inline = tok.partition("=")
        flag = FLAGS.get(name)
        if flag is None:
            raise SlimeArgsError(f"{name}: not a flag of slime 624b824 (slime's parser would ignore it)")
        if flag.kind == "switch":
            if eq:
                raise SlimeArgsError(f"{name} takes no value")
            setattr(ns, flag.dest, True)
            continue
        if eq:
            raw = inline
        elif i < len(toks) and not toks[i].startswith("--"):
            raw, i = toks[i], i + 1
        else:
            raise SlimeArgsError(f"{name} needs a value")
        try:
            value = {"str": str, "int": int, "float": float}[flag.kind](raw)
        except ValueError:
            raise SlimeArgsError(f"{name} {raw!r}: not a {flag.kind}") from None
        if flag.choices is not None and value not in flag.choices:
            raise SlimeArgsError(f"{name} {value!r}: not one of {flag.choices}")
        setattr(ns, flag.dest, value)
    return ns


def _resolves(path: str) -> bool:
    module, _, attr = path.rpartition(".")
    try:
        return callable(getattr(importlib.import_module(module), attr, None))
    except ImportError:
        return False


def validate(args: Any, *, yaml_keys: dict[str, Any] | None = None, architecture: str | None = None) -> Any:
    """slime 624b824's checks (module docstring) on ``args``, in slime's order; then sets ``yaml_keys`` (the
    ``--custom-config-path`` file's content) on ``args`` as slime does. Returns ``args``; raises
    :class:`SlimeArgsError` with slime's reason."""
    a = lambda name, default=None: getattr(args, name, default)  # noqa: E731
    if not a("rollout_temperature", 1.0) > 0:
        raise SlimeArgsError("--rollout-temperature must be > 0")
    if a("kl_coef", 0.0) != 0 and a("kl_loss_coef", 0.0) != 0:
        raise SlimeArgsError("only one of --kl-coef and --kl-loss-coef can be set")
    if a("advantage_estimator") in ("reinforce_plus_plus", "reinforce_plus_plus_baseline") and not a(
            "normalize_advantages"):
        raise SlimeArgsError(f"--advantage-estimator {a('advantage_estimator')} requires --normalize-advantages")
    if a("use_rollout_logprobs") and a("use_tis"):
        raise SlimeArgsError("--use-rollout-logprobs and --use-tis cannot be set at the same time")
    if a("get_mismatch_metrics") and a("custom_tis_function_path") is None:
        raise SlimeArgsError("--get-mismatch-metrics needs --custom-tis-function-path")
    if a("use_dynamic_batch_size") and a("max_tokens_per_gpu") is None:
        raise SlimeArgsError("--use-dynamic-batch-size needs --max-tokens-per-gpu")
    steps = a("num_steps_per_rollout")
    if steps is not None:
        gbs = a("rollout_batch_size") * a("n_samples_per_prompt", 1) // steps
        if a("global_batch_size") is not None and a("global_batch_size") != gbs:
            raise SlimeArgsError(f"--global-batch-size {a('global_batch_size')} is not --rollout-batch-size "
                                 f"{a('rollout_batch_size')} * --n-samples-per-prompt {a('n_samples_per_prompt', 1)} "
                                 f"// --num-steps-per-rollout {steps} = {gbs}")
        args.global_batch_size = gbs
    if a("num_epoch") is None and a("num_rollout") is None:
        raise SlimeArgsError("set --num-rollout or --num-epoch")
    if a("allgather_cp") and a("context_parallel_size", 1) > 1 and architecture not in DSA_ARCHITECTURES:
        raise SlimeArgsError("--allgather-cp with --context-parallel-size > 1 is only supported for DSA attention "
                             "models (DeepSeek-V3.2, GLM-5.1)")
    for name, flag in FLAGS.items():
        value = a(flag.dest)
        if name.endswith("-path") and name != "--custom-config-path" and isinstance(value, str) and (
                value.startswith("slime_tis.") and not _resolves(value)):
            raise SlimeArgsError(f"{name} {value}: no such function")
    if a("custom_config_path") and yaml_keys:
        for key, value in yaml_keys.items():
            setattr(args, key, value)
    return args


def slime_accepts(tokens: list[str] | str, *, yaml_text: str | None = None, base: str = BASE,
                  architecture: str | None = None) -> SimpleNamespace:
    """:func:`parse` then :func:`validate`; ``yaml_text`` is the ``--custom-config-path`` file."""
    keys = yaml.safe_load(yaml_text) if yaml_text else None
    return validate(parse(tokens, base=base), yaml_keys=keys or None, architecture=architecture)
