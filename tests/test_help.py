"""`gptrain train --help`: every flag the parser knows has a Megatron group and a one-line help
(gptrain/flag_help.py), and the accepted no-op and refused flags are listed with their reasons."""
from __future__ import annotations

import argparse
import re

import pytest

from gptrain import flag_help
from gptrain.config import ACCEPTED_NO_OP, ACCEPTED_NO_OP_WITH_VALUE, NOT_IMPLEMENTED, _parser


def _flags(parser: argparse.ArgumentParser):
    return [a for a in parser._actions if not isinstance(a, argparse._HelpAction)]


def test_every_flag_has_a_group_and_one_line_of_help():
    parser = _parser()
    missing, bad = [], []
    for action in _flags(parser):
        if action.help == argparse.SUPPRESS:
            continue
        name = flag_help.primary_name(action)
        if name not in flag_help.FLAGS:
            missing.append(name)
            continue
        group = flag_help.FLAGS[name][0]
        if group not in flag_help.GROUPS or not action.help or "\n" in action.help or len(action.help) > 400:
            bad.append(name)
    assert not missing, f"add these flags to gptrain/flag_help.py FLAGS (group, help): {missing}"
    assert not bad, f"flags with an unknown group or without a one-line help: {bad}"


def test_no_stale_entries_and_every_hidden_flag_has_a_reason():
    parser = _parser()
    known = {flag_help.primary_name(a) for a in _flags(parser)}
    assert set(flag_help.FLAGS) <= known, f"entries for flags the parser lacks: {set(flag_help.FLAGS) - known}"
    hidden = {flag_help.primary_name(a) for a in _flags(parser) if a.help == argparse.SUPPRESS}
    assert hidden == set(ACCEPTED_NO_OP) | set(ACCEPTED_NO_OP_WITH_VALUE)
    assert set(flag_help.NO_OP_VALUE_REASONS) == set(ACCEPTED_NO_OP_WITH_VALUE)
    assert all(ACCEPTED_NO_OP.values()) and all(NOT_IMPLEMENTED.values())


def test_help_output_groups_flags_as_megatron_does(capsys):
    from gptrain.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    # Megatron's group titles (megatron/training/arguments.py), in its order, then gptrain's own
    titles = [t for t in re.findall(r"^(\S[^\n]*):$", out, re.M) if t in flag_help.GROUPS]
    assert titles == list(flag_help.GROUPS)
    sections = dict(re.findall(r"^(\S[^\n]*):\n((?:  .*\n)+)", out, re.M))
    assert "--num-layers N " in sections["network size"] and "--hidden-dropout X " in sections["regularization"]
    assert "--lr X " in sections["learning rate"] and "--save PATH " in sections["checkpointing"]
    assert "--bf16 " in sections["mixed precision"] and "--tensor-model-parallel-size N " in sections["distributed"]
    assert "--seq-length N " in sections["data and dataloader"] and "--eval-iters N " in sections["validation"]
    assert "other (no entry" not in out
    # every visible flag is printed once, with its help text
    for action in _flags(_parser()):
        if action.help != argparse.SUPPRESS:
            assert len(re.findall(rf"^  {re.escape(action.option_strings[0])}[ ,\n]", out, re.M)) == 1
    no_op = sections["accepted Megatron flags that change nothing here"]
    refused = sections["refused Megatron flags (an error, never ignored)"]
    for flag, reason in ACCEPTED_NO_OP.items():
        assert f"  {flag}: {reason}\n" in no_op
    assert "  --dataset-impl VALUE (mmap only): only mmap files exist\n" in no_op
    for flag, reason in NOT_IMPLEMENTED.items():
        assert f"  {flag}: {reason}\n" in refused


def test_a_flag_without_an_entry_is_shown_apart_and_named_by_the_test():
    parser = argparse.ArgumentParser(prog="x")
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--brand-new-flag", type=int, help="someone's new flag")
    out = flag_help.apply(parser).format_help()
    assert re.search(r"network size:\n  --num-layers N +transformer layers \(default: 2\)\n", out)
    assert re.search(r"other \(no entry in gptrain/flag_help.py yet\):\n  --brand-new-flag N +someone's new flag", out)


def test_refused_and_unknown_flags_fail_with_one_line(capsys):
    from gptrain.config import parse_megatron_args

    with pytest.raises(ValueError, match=r"--swiglu is a Megatron flag gptrain does not implement: only the GPT-2"):
        parse_megatron_args(["--swiglu", "--mock-data", "--train-iters", "1"])
    with pytest.raises(ValueError, match=r"unknown flag\(s\) --no-such-flag: .*gptrain train --help"):
        parse_megatron_args(["--no-such-flag", "--mock-data", "--train-iters", "1"])
