"""Every slime command line the docs give, and every flag a refusal tells a slime user to add, is one slime accepts.

slime's own argument checks (slime 624b824, restated in tests/_slime_args.py, its batch-size rule included) run
over: each ``bash`` / ``diff`` block of docs/slime.md, of the README's slime section and of patches/README_slime.md
(a new block is checked when it is written), with the YAML block that follows it, added to the batch flags of each
of slime's own example scripts; every ``--flag`` the slime docs name; and the advice
of each refusal: the refusal's scenario is a command line slime accepts, the flags the message says to add keep
it accepted, and with them the plugin trains instead of refusing.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from _slime_args import EXAMPLE_SCRIPTS, FLAGS, SlimeArgsError, parse, slime_accepts, validate
from _slime_sim import Layout, initial_weights, make_rollouts, schedule, slime_args, train_rollout

from slime_tis.slime import tis_config_from_slime_args

ROOT = Path(__file__).resolve().parents[1]

#: flags the slime docs name that are not slime 624b824 flags, each for a stated reason
NOT_SLIME_FLAGS = {
    "--no-deps": "pip's",
    "--check": "git apply's",
    "--format": "slime-tis diagnose's (its recommendation as slime's YAML keys)",
    "--tis-mode": "the plugin's own flag (Megatron launchers), named as the source of the YAML key",
    "--use-rollout-correction": "named by slime's mis README, defined nowhere in slime (docs say so)",
    "--mis-mode": "named by slime's mis README, defined nowhere in slime (docs say so)",
    "--mis-level": "as above",
    "--mis-lower-bound": "as above",
    "--mis-upper-bound": "as above",
    "--mis-veto-threshold": "as above",
    "--mis-batch-normalize": "as above",
    "--tis-level": "slime's mis README names YAML keys as flags; docs say they are YAML keys",
    "--rs-level": "as above",
    "--rs-batch-refill": "an open slime change (docs: slime's open changes)",
}


def _section(path: Path, heading: str | None) -> str:
    text = path.read_text(encoding="utf-8")
    if heading is None:
        return text
    start = text.index(heading)
    end = text.find("\n## ", start + len(heading))
    return text[start:end if end > 0 else None]


DOCS = {
    "docs/slime.md": _section(ROOT / "docs/slime.md", None),
    "README.md": _section(ROOT / "README.md", "## Host 3: slime"),
    "docs/getting_started.md": _section(ROOT / "docs/getting_started.md", "## slime (YAML keys)"),
    "patches/README_slime.md": _section(ROOT / "patches/README_slime.md", None),
}


def _blocks(text: str) -> list[tuple[str, str, str | None]]:
    """``(kind, body, yaml)`` per ``bash`` / ``diff`` block, with the ``yaml`` block right after it (if any)."""
    found = list(re.finditer(r"```(\w+)\n(.*?)```", text, flags=re.S))
    out = []
    for k, m in enumerate(found):
        if m.group(1) not in ("bash", "diff"):
            continue
        nxt = found[k + 1] if k + 1 < len(found) else None
        gap = text[m.end():nxt.start()] if nxt else ""
        yml = nxt.group(2) if nxt and nxt.group(1) == "yaml" and "```" not in gap and len(gap) < 400 else None
        out.append((m.group(1), m.group(2), yml))
    return out


def _diff_sides(body: str) -> list[str]:
    """The script before and after a diff (``-`` / ``+`` lines, context in both)."""
    lines = [ln for ln in body.splitlines() if not ln.startswith(("---", "+++", "@@"))]
    return ["\n".join(ln[1:] for ln in lines if ln[:1] in (" ", sign) or ln == "") for sign in ("-", "+")]


def _commands() -> list[tuple[str, str, str | None, str]]:
    """``(id, command text, YAML, side)``: a bash block as it is, a diff block as the script before and after."""
    out = []
    for where, doc in DOCS.items():
        for i, (kind, body, yml) in enumerate(_blocks(doc)):
            if kind == "bash":
                out.append((f"{where}#{i}", body, yml, ""))
            else:
                before, after = _diff_sides(body)
                out += [(f"{where}#{i}-before", before, None, "-before"), (f"{where}#{i}-after", after, yml, "-after")]
    return out


COMMANDS = _commands()


def test_the_docs_have_command_lines():
    assert sum(1 for c in COMMANDS if c[0].startswith("docs/slime.md")) >= 8
    assert any(c[0].endswith("-after") for c in COMMANDS)  # the run-script diff


@pytest.mark.parametrize(("where", "text", "yml", "side"), COMMANDS, ids=[c[0] for c in COMMANDS])
def test_documented_command_line_passes_slimes_checks(where, text, yml, side):
    """slime accepts it added to each example script's batch flags (``--global-batch-size`` = rollout batch size *
    samples per prompt // steps per rollout where steps are set); with its YAML the plugin builds its
    configuration from what slime hands it."""
    arch = re.search(r"architectures (\w+)", text)  # slime reads it from --hf-checkpoint's config.json
    for script, base in EXAMPLE_SCRIPTS.items():
        try:
            args = slime_accepts(text, yaml_text=yml, base=base, architecture=arch.group(1) if arch else None)
        except SlimeArgsError as e:
            pytest.fail(f"added to {script}'s flags ({base}): {e}")
        if yml is not None and "slime_tis." in text:
            tis_config_from_slime_args(args, algorithm="loss")


@pytest.mark.parametrize("script", sorted(EXAMPLE_SCRIPTS))
def test_example_scripts_pass_the_batch_size_rule(script):
    args = slime_accepts("", base=EXAMPLE_SCRIPTS[script])
    steps = args.num_steps_per_rollout or 1
    assert args.global_batch_size * steps == args.rollout_batch_size * args.n_samples_per_prompt


def test_every_flag_the_slime_docs_name_is_a_slime_flag():
    named = {f for doc in DOCS.values() for f in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*[a-z0-9]", doc)}
    unknown = sorted(named - set(FLAGS) - set(NOT_SLIME_FLAGS))
    assert not unknown, f"not flags of slime 624b824 (tests/_slime_args.py lists the ones slime defines): {unknown}"


@pytest.mark.parametrize(("cmd", "reason"), [
    ("--get-mismatch-metrics", "--custom-tis-function-path"),
    ("--use-rollout-logprobs --use-tis", "cannot be set at the same time"),
    ("--use-rollout-correction", "not a flag"),
    ("--advantage-estimator reinforce", "not one of"),
    ("--allgather-cp --context-parallel-size 2", "DSA"),
    ("--custom-tis-function-path slime_tis.slime.no_such_hook", "no such function"),
    ("--use-dynamic-batch-size", "--max-tokens-per-gpu"),
    ("--num-steps-per-rollout 2 --global-batch-size 64", "--global-batch-size"),
    # run-qwen3-4B.sh's --global-batch-size 256 with 2 steps (slime: 256 is not 32 * 8 // 2)
    ("--num-steps-per-rollout 2", "--global-batch-size 256 is not --rollout-batch-size 32 * --n-samples-per-prompt 8 "
                                  "// --num-steps-per-rollout 2 = 128"),
])
def test_the_stand_in_refuses_what_slime_refuses(cmd, reason):
    with pytest.raises(SlimeArgsError, match=re.escape(reason)):
        slime_accepts(cmd)


def test_yaml_keys_are_set_after_slimes_checks():
    """slime sets the --custom-config-path keys after its checks: a YAML ``use_tis`` meets no assertion."""
    args = slime_accepts("--use-rollout-logprobs --custom-config-path mis.yaml", yaml_text="use_tis: true\n")
    assert args.use_tis is True and args.use_rollout_logprobs is True


# ------------------------------------------------------------------------------------------ refusal advice
SIZES = [1, 2, 3, 2, 4, 1, 2, 3]  # samples per rollout: multi-sample rollouts, split by --micro-batch-size 1
POST = "--rollout-data-postprocess-path slime_tis.slime.postprocess_rollout_data --custom-config-path tis.yaml"
ALG2 = f"--use-tis --custom-tis-function-path slime_tis.slime.compute_tis_for_slime {POST}"
ALG3 = (f"--use-rollout-logprobs --loss-type custom_loss --custom-loss-function-path slime_tis.slime.reinforce_is_loss "
        f"{POST}")

REFUSALS = [  # (name, command line, YAML, optimizer steps per rollout)
    ("TIS hook, global normalisation, one step", ALG2, "tis_batch_normalize: true\n", 1),
    ("custom loss, dump, one step", ALG3, "tis_dump_dir: {dump}\n", 1),
]


def _advice(message: str) -> list[list[str]]:
    """The alternatives of flags the message says to add: ``add --a [v] --b [v]`` and each ``, or --c [v]``
    after it, up to the first word that is neither a flag nor a flag's value."""
    out = []
    for m in re.finditer(r"\badd (--.*)", message):
        for alt in re.split(r",? or (?=--)", m.group(1)):
            toks, words = [], alt.split()
            i = 0
            while i < len(words) and words[i].startswith("--"):
                flag = FLAGS.get(words[i])
                toks.append(words[i])
                if flag is not None and flag.kind != "switch" and i + 1 < len(words):
                    toks.append(words[i + 1])
                    i += 1
                i += 1
            out.append(toks)
        break  # the alternatives of the first "add" cover the rest of the message
    return out


def _harness_args(cmd: str, yml: str, tokens: list[str] = ()):
    ns = validate(parse(cmd.split() + list(tokens)), yaml_keys=yaml.safe_load(yml))
    keep = {k: v for k, v in vars(ns).items() if k not in ("rollout_temperature", "log_probs_chunk_size")}
    return slime_args(**keep)


@pytest.mark.parametrize(("name", "cmd", "yml", "steps"), REFUSALS, ids=[r[0] for r in REFUSALS])
def test_refusal_advice_is_accepted_by_slime_and_removes_the_refusal(name, cmd, yml, steps, tmp_path):
    """The scenario is a slime command line; it is refused; each advised addition keeps it one slime accepts,
    and with it the hooks train the rollout."""
    yml = yml.format(dump=tmp_path)
    w0 = initial_weights(1)
    ro = make_rollouts(3, SIZES, w0)
    sched = schedule(ro, steps=steps, micro_batch_size=1)
    with pytest.raises(ValueError) as refused:
        train_rollout(_harness_args(cmd, yml), ro, w0, sched, Layout())
    alternatives = _advice(str(refused.value))
    assert alternatives and all(alternatives), f"no flags to add in: {refused.value}"
    for tokens in alternatives:
        try:
            slime_accepts(cmd.split() + tokens, yaml_text=yml)
        except SlimeArgsError as e:
            pytest.fail(f"advice {' '.join(tokens)!r} of {str(refused.value)[:120]!r}...: slime refuses it: {e}")
        res = train_rollout(_harness_args(cmd, yml, tokens), ro, w0, sched, Layout())
        assert len(res) == steps
