"""`gptrain train --help`, the parser and the table of accepted and refused Megatron flags are all
generated from one set of declarations (gptrain/config.py, gptrain/flags.py): every accepted flag
appears once, in its group, and the table and the parser agree with them."""
from __future__ import annotations

import argparse
import dataclasses
import re

import pytest

from gptrain import config, flags
from gptrain.config import build_parser, declared_flags, parse_megatron_args
from gptrain.flag_tables import COMPATIBILITY, DERIVED_FLAGS, MODEL_FLAGS
from gptrain.model.gpt import GPTConfig

BASE = ["--mock-data", "--train-iters", "1"]


def _help_text(capsys) -> str:
    from gptrain.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--help"])
    assert exit_info.value.code == 0
    return capsys.readouterr().out


def _sections(out: str) -> dict[str, str]:
    return dict(re.findall(r"^(\S[^\n]*):\n((?:  .*\n)+)", out, re.M))


def test_every_declared_flag_appears_once_in_help_with_its_group(capsys):
    out = _help_text(capsys)
    sections = _sections(out)
    # Megatron's group titles (megatron/training/arguments.py), in its order, then gptrain's own
    titles = [t for t in re.findall(r"^(\S[^\n]*):$", out, re.M) if t in flags.GROUPS]
    assert titles == list(flags.GROUPS)
    declared = declared_flags()
    names = [n for f in declared for n in f.names]
    assert len(names) == len(set(names)), "a flag name declared twice"
    for f in declared:
        # listed once in the whole text, and that once under its own group, aliases on its line
        pattern = rf"^  {re.escape(f.name)}[ ,\n]"
        assert len(re.findall(pattern, out, re.M)) == 1, f.name
        assert re.search(pattern, sections[f.group], re.M), f"{f.name} not under {f.group!r}"
        for alias in f.names[1:]:
            assert re.search(rf"^  {re.escape(f.name)}[^\n]*, {re.escape(alias)}[ \n]", sections[f.group], re.M)
    # the flags in the help are exactly the declared ones and argparse's -h
    listed = set(re.findall(r"^  (--[\w-]+)", "".join(sections[g] for g in flags.GROUPS), re.M))
    assert listed == {f.name for f in declared}
    assert "  -h, --help" in sections["options"]
    # spot checks of the generated lines (metavar, default)
    assert re.search(r"^  --num-layers N +transformer layers \(default: 24\)$", sections["network size"], re.M)
    assert "--lr X " in sections["learning rate"] and "--save PATH " in sections["checkpointing"]
    assert "--data-path PATH [PATH ...]" in sections["data and dataloader"]
    assert "--overlap-grad-reduce " in sections["distributed"] and "--ddp-bucket-size N " in sections["distributed"]


def test_the_parser_is_the_declarations():
    """Every parser action is a declared flag (visible, with its declared help and default) or a
    hidden accepted no-op of the compatibility table; refused flags are not in the parser."""
    parser = build_parser()
    declared = {f.name: f for f in declared_flags()}
    compat = {c.name: c for c in COMPATIBILITY}
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        name = action.option_strings[0]
        if action.help == argparse.SUPPRESS:
            assert compat[name].kind in ("switch", "value")
            continue
        f = declared[name]
        assert tuple(action.option_strings) == f.names and action.help == f.help and action.dest == f.dest
        if f.default is not flags.FIELD_DEFAULT and f.action not in ("store_true", "store_false"):
            assert action.default == f.default, name
    in_parser = {o for a in parser._actions for o in a.option_strings}
    assert set(declared) <= in_parser
    assert {c.name for c in COMPATIBILITY if c.kind != "refused"} <= in_parser
    assert not {c.name for c in COMPATIBILITY if c.kind == "refused"} & in_parser


def test_field_flags_take_the_fields_defaults_and_types():
    """A field's flag has the field's default and type (except where the parser must tell "not
    given" apart); GPTConfig's flags (MODEL_FLAGS) name real fields."""
    assert set(MODEL_FLAGS) <= {f.name for f in dataclasses.fields(GPTConfig)}
    not_given = {"micro_batch_size", "zero_stage", "offload_fraction"}  # None: filled from a ds.json or another flag
    sections = config.field_flags()
    classes = {"model": GPTConfig, **config._SECTION_CLASSES}
    dests = [f.dest for fs in sections.values() for f in fs]
    assert len(dests) == len(set(dests)), "two fields with the same name carry flags"
    for section, fs in sections.items():
        fields = {fl.name: fl for fl in dataclasses.fields(classes[section])}
        for f in fs:
            fl = fields[f.dest]
            default = fl.default_factory() if fl.default_factory is not dataclasses.MISSING else fl.default
            if f.dest in not_given:
                assert f.default is None
            elif f.action == "store_false":
                assert default is True
            else:
                assert f.default == default, f.name
            if isinstance(default, bool):
                assert f.action in ("store_true", "store_false")
            elif isinstance(default, (int, float)) and not isinstance(default, bool) and f.choices is None:
                assert f.type is type(default), f.name
    # every value that the parser reads with its default builds the same config as the dataclasses
    cfg, _ = parse_megatron_args(BASE, world_size=1)
    assert cfg.data == config.DataConfig(mock_data=True)
    assert cfg.optim == config.OptimConfig() and cfg.precision == config.PrecisionConfig()
    assert cfg.kernels == config.KernelConfig() and cfg.parallel == config.ParallelConfig()
    assert cfg.model == GPTConfig()


def test_compatibility_table_and_parser_agree(capsys):
    out = _help_text(capsys)
    sections = _sections(out)
    no_op = sections["accepted Megatron flags that change nothing here"]
    refused = sections["refused Megatron flags (an error, never ignored)"]
    assert len(no_op.splitlines()) == sum(c.kind != "refused" for c in COMPATIBILITY)
    assert len(refused.splitlines()) == sum(c.kind == "refused" for c in COMPATIBILITY)
    for c in COMPATIBILITY:
        if c.kind == "switch":
            assert f"  {c.name}: {c.reason}\n" in no_op
            _, notes = parse_megatron_args(BASE + [c.name], world_size=1)
            assert notes == [f"{c.name}: accepted, {c.reason}"]
        elif c.kind == "value":
            values = f" ({' or '.join(c.values)} only)" if c.values else ""
            assert f"  {c.name} VALUE{values}: {c.reason}\n" in no_op
            parse_megatron_args(BASE + [c.name, c.values[0] if c.values else "3"], world_size=1)
            if c.values:
                with pytest.raises(ValueError, match=rf"^{re.escape(c.name)} other: only "):
                    parse_megatron_args(BASE + [c.name, "other"], world_size=1)
        else:
            assert f"  {c.name}: {c.reason}\n" in refused
            message = f"{c.name} is a Megatron flag gptrain does not implement: {c.reason}"
            with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
                parse_megatron_args(BASE + [c.name], world_size=1)
            with pytest.raises(ValueError, match=re.escape(c.name)):
                parse_megatron_args(BASE + [f"{c.name}=x"], world_size=1)
    assert "  --dataset-impl VALUE (mmap only): only mmap files exist\n" in no_op
    assert out.rstrip().endswith("any other unknown flag is refused too.")


def test_a_declaration_without_a_group_or_help_is_refused():
    with pytest.raises(ValueError, match="group 'nowhere' is not one of"):
        flags.Flag(("--brand-new-flag",), "nowhere", "someone's new flag")
    with pytest.raises(ValueError, match="one line of help"):
        flags.Flag(("--brand-new-flag",), "training", "")
    with pytest.raises(ValueError, match="declared twice"):
        flags.build_parser([flags.Flag(("--x",), "training", "x", dest="a"),
                            flags.Flag(("--x",), "logging", "x again", dest="b")], [])
    with pytest.raises(ValueError, match="both a flag and in the compatibility table"):
        flags.build_parser([flags.Flag(("--x",), "training", "x", dest="a")], [flags.Compat("--x", "why")])


def test_derived_flags_are_read_by_the_translation():
    """Each derived flag changes the config it is said to change."""
    parse = lambda *extra: parse_megatron_args(BASE + list(extra), world_size=4)[0]  # noqa: E731
    assert parse("--checkpoint-activations").kernels.recompute == "full"
    assert parse("--recompute-activations").kernels.recompute == "selective"
    assert parse("--recompute-granularity", "selective").kernels.recompute == "selective"
    assert parse("--recompute-granularity", "full", "--recompute-method", "uniform",
                 "--recompute-num-layers", "1").kernels.recompute == "full"
    assert parse("--bf16", "--fp8").precision.fp8 == "hybrid"
    assert parse("--use-distributed-optimizer").parallel.zero_stage == 1
    assert parse("--optimizer", "adam") == parse()
    assert parse("--use-rotary-position-embeddings").model.position_embedding_type == "rope"
    with pytest.raises(ValueError, match="--deepspeed needs --deepspeed_config"):
        parse("--deepspeed")
    assert {f.name for f in DERIVED_FLAGS} == {"--checkpoint-activations", "--recompute-activations",
                                               "--recompute-granularity", "--recompute-method",
                                               "--recompute-num-layers", "--optimizer", "--fp8",
                                               "--use-distributed-optimizer", "--deepspeed", "--world-size",
                                               "--simulate-world-size", "--simulate-rank", "--no-fp16", "--no-bf16",
                                               "--bias-gelu-fusion", "--use-rotary-position-embeddings"}
    # the negative/positive halves of switches: the last one given wins
    assert parse("--fp16", "--no-fp16").precision == parse().precision
    assert parse("--fp16", "--no-fp16", "--bf16").precision.bf16
    assert parse("--bf16", "--no-bf16").precision.name == "fp32"
    assert parse("--no-fp16", "--fp16").precision.fp16
    assert not parse("--bias-gelu-fusion", "--no-bias-gelu-fusion").kernels.bias_gelu_fusion
    assert parse("--no-bias-gelu-fusion", "--bias-gelu-fusion").kernels.bias_gelu_fusion
    # the simulator's pair is taken before parsing (parallel/simulate.py) and parses as a no-op after
    assert parse("--simulate-world-size", "8", "--simulate-rank", "3") == parse()


def test_new_data_parallel_flags_set_their_fields():
    cfg, notes = parse_megatron_args(BASE + ["--overlap-grad-reduce", "--ddp-bucket-size", "1000",
                                             "--grad-reduce-in-bf16", "--overlap-param-gather"], world_size=1)
    p = cfg.parallel
    assert (p.overlap_grad_reduce, p.ddp_bucket_size, p.grad_reduce_in_bf16, p.overlap_param_gather) == \
        (True, 1000, True, True)
    assert notes == []
    p = parse_megatron_args(BASE, world_size=1)[0].parallel
    assert (p.overlap_grad_reduce, p.ddp_bucket_size, p.grad_reduce_in_bf16, p.overlap_param_gather) == \
        (False, None, False, False)


def test_micro_batches_per_step_counts_data_parallelism():
    cfg, _ = parse_megatron_args(BASE + ["--micro-batch-size", "2", "--global-batch-size", "16"], world_size=1)
    assert [cfg.train.micro_batches_per_step(dp) for dp in (1, 2, 4, 8)] == [8, 4, 2, 1]
    with pytest.raises(ValueError, match="not divisible by --micro-batch-size 2 x data-parallel size 3"):
        cfg.train.micro_batches_per_step(3)
    # the default global batch is one micro-batch per data-parallel rank
    cfg, _ = parse_megatron_args(BASE + ["--micro-batch-size", "2", "--tensor-model-parallel-size", "2"], world_size=8)
    assert cfg.train.global_batch_size == 8 and cfg.train.micro_batches_per_step(4) == 1


def test_config_is_final_once_built():
    """The tokenizer's vocabulary makes a new config (checked again); the parsed one is untouched."""
    cfg, _ = parse_megatron_args(BASE, world_size=1)
    new = cfg.with_tokenizer(1000, 999)
    assert (new.model.vocab_size, new.data.eod_token) == (1000, 999)
    assert (cfg.model.vocab_size, cfg.data.eod_token) == (50257, None)
    assert new.model.padded_vocab_size == 1024 and new.train == cfg.train
    with pytest.raises(ValueError, match="vocab_size must be positive"):
        cfg.with_tokenizer(0, 0)


def test_refused_and_unknown_flags_fail_with_one_line():
    with pytest.raises(ValueError, match=r"--qk-layernorm is a Megatron flag gptrain does not implement: not impl"):
        parse_megatron_args(["--qk-layernorm", "--mock-data", "--train-iters", "1"])
    with pytest.raises(ValueError, match=r"unknown flag\(s\) --no-such-flag: .*gptrain train --help"):
        parse_megatron_args(["--no-such-flag", "--mock-data", "--train-iters", "1"])


def test_a_typo_is_answered_with_the_closest_flag_and_bad_values_in_one_line():
    with pytest.raises(ValueError, match=r"^unknown flag\(s\) --num-layer: .*; did you mean --num-layers\? \(see "):
        parse_megatron_args(BASE + ["--num-layer", "2"], world_size=1)
    with pytest.raises(ValueError, match=r"^unknown flag\(s\) --hiden-size: .*; did you mean --hidden-size\? "):
        parse_megatron_args(BASE + ["--hiden-size=8"], world_size=1)
    # a Megatron flag gptrain lacks is not a typo of a gptrain flag with another meaning
    for megatron_flag in ("--lr-wsd-decay-samples", "--log-memory-to-tensorboard", "--moe-router-topk"):
        with pytest.raises(ValueError, match=r"does not implement rather than ignoring them \(") as err:
            parse_megatron_args(BASE + [megatron_flag, "1"], world_size=1)
        assert "did you mean" not in str(err.value)
    # argparse's own errors are one line too (no usage block, no SystemExit)
    with pytest.raises(ValueError, match=r"^argument --num-layers: invalid int value: 'x' \(see `gptrain train "
                                         r"--help`\)$"):
        parse_megatron_args(BASE + ["--num-layers", "x"], world_size=1)


def test_a_typo_exits_2_with_one_line(capsys):
    from gptrain.train.run import train_main

    assert train_main(BASE + ["--num-layer", "2"]).exit_code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["gptrain: error: unknown flag(s) --num-layer: gptrain refuses flags it does not implement rather "
                   "than ignoring them; did you mean --num-layers? (see `gptrain train --help`)"]


def test_current_megatron_flags_are_accepted_or_refused_with_their_reason():
    """core_r0.8.0 to main (examples/gpt3): the no-op ones parse to the default config with a note."""
    default = parse_megatron_args(BASE, world_size=1)[0]
    for extra in (["--use-mcore-models"], ["--use-legacy-models"], ["--no-persist-layer-norm"],
                  ["--transformer-impl", "local"], ["--transformer-impl", "transformer_engine"],
                  ["--timing-log-level", "2"], ["--dataloader-type", "single"]):
        cfg, notes = parse_megatron_args(BASE + extra, world_size=1)
        assert cfg == default, extra
    with pytest.raises(ValueError, match=r"^--dataloader-type cyclic: only single is supported; .*cyclic's new random "
                                         r"order every epoch is not implemented$"):
        parse_megatron_args(BASE + ["--dataloader-type", "cyclic"], world_size=1)
    with pytest.raises(ValueError, match=r"^--timing-log-level 3: only 0 or 1 or 2"):
        parse_megatron_args(BASE + ["--timing-log-level", "3"], world_size=1)
    cfg, _ = parse_megatron_args(BASE + ["--exit-on-missing-checkpoint", "--log-throughput", "--log-params-norm",
                                         "--log-timers-to-tensorboard", "--wandb-project", "p", "--wandb-exp-name", "e",
                                         "--wandb-save-dir", "w"], world_size=1)
    t = cfg.train
    assert (t.exit_on_missing_checkpoint, t.log_throughput, t.log_params_norm, t.log_timers_to_tensorboard) == \
        (True, True, True, True)
    assert (t.wandb_project, t.wandb_exp_name, t.wandb_save_dir) == ("p", "e", "w")


def test_train_help_imports_no_torch():
    """`gptrain train --help` is the flag declarations alone: no torch, no compiler stack (well under 2 s)."""
    import subprocess
    import sys
    import time

    code = ("import sys\nfrom gptrain.cli import main\ntry:\n    main(['train', '--help'])\nexcept SystemExit as e:\n"
            "    assert e.code == 0\n"
            "heavy = [m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy', 'triton')]\n"
            "assert not heavy, heavy[:5]\n")
    start = time.perf_counter()
    root = str(__import__("pathlib").Path(__file__).parents[1])
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**__import__("os").environ, "PYTHONPATH": root})
    assert done.returncode == 0, done.stderr
    assert "--log-throughput" in done.stdout and "--use-mcore-models: " in done.stdout
    assert time.perf_counter() - start < 2.0
