"""What a Megatron user reads when `gptrain train` starts and runs (issue 30): the arguments dump and the
`[after ...] datetime:` lines as Megatron prints them, the iteration line's --log-throughput and
--log-params-norm fields, the ETA under --exit-duration-in-mins, wandb and --log-timers-to-tensorboard,
--exit-on-missing-checkpoint, and the path problems reported in one line before the model is built."""
from __future__ import annotations

import importlib.machinery
import re
import sys
import time
import types
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from gptrain.train import interval_log, metrics, startup
from gptrain.train.run import train_main
from tiny import TINY_FLAGS

RUN = TINY_FLAGS + ["--seq-length", "16", "--micro-batch-size", "2", "--device", "cpu", "--eval-iters", "1",
                    "--eval-interval", "100"]


class FakeWandb(types.ModuleType):
    """Stands in for the wandb package: records init's arguments and each log call."""

    def __init__(self):
        super().__init__("wandb")
        self.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
        self.inits, self.logged, self.finished = [], [], 0

    def init(self, **kwargs):
        self.inits.append(kwargs)
        return self

    def log(self, values, step=None):
        self.logged.append((step, dict(values)))

    def finish(self):
        self.finished += 1


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One tiny run with every logging flag, wandb faked, its log lines kept."""
    tmp = tmp_path_factory.mktemp("startup")
    fake = FakeWandb()
    saved = sys.modules.get("wandb")
    sys.modules["wandb"] = fake
    lines: list[str] = []
    try:
        result = train_main(RUN + ["--mock-data", "--train-iters", "4", "--log-interval", "2", "--log-throughput",
                                   "--log-params-norm", "--log-timers-to-tensorboard", "--tensorboard-dir",
                                   str(tmp / "tb"), "--wandb-project", "proj", "--wandb-exp-name", "exp",
                                   "--save", str(tmp / "ck"), "--fp16", "--no-fp16"], log=lines.append)
    finally:
        if saved is None:
            sys.modules.pop("wandb", None)
        else:
            sys.modules["wandb"] = saved
    assert result.exit_code == 0
    return SimpleNamespace(lines=lines, text="\n".join(lines), wandb=fake, tmp=tmp)


def test_arguments_dump_is_megatrons(run):
    text = run.text
    begin = text.index("------------------------ arguments ------------------------\n")
    end = text.index("\n-------------------- end of arguments ---------------------")
    body = text[begin:end].splitlines()[1:]
    assert body == sorted(body, key=str.lower) and len(body) > 100
    for line in body:  # Megatron's _print_args: two spaces, the name, dots to column 50, the value
        m = re.fullmatch(r"  (\w+) (\.+) (.*)", line)
        assert m and len(m.group(1)) + len(m.group(2)) == 48, line
    values = dict(re.fullmatch(r"  (\w+) \.+ (.*)", line).groups() for line in body)
    assert values["num_layers"] == "2" and values["hidden_size"] == "32" and values["seq_length"] == "16"
    assert values["tensor_model_parallel_size"] == "1" and values["pipeline_model_parallel_size"] == "1"
    assert values["global_batch_size"] == "2" and values["data_parallel_size"] == "1"
    assert values["fp16"] == "False" and values["params_dtype"] == "torch.float32"  # --fp16 --no-fp16
    assert values["bias_gelu_fusion"] == "True" and values["masked_softmax_fusion"] == "True"
    assert values["log_throughput"] == "True" and values["padded_vocab_size"] == "50304"
    assert values["adam_eps"] == "1e-08" and values["split"] == "969,30,1"


def test_datetime_lines_at_megatrons_points(run):
    stamps = [line for line in run.lines if "] datetime: " in line]
    for line in stamps:
        assert re.fullmatch(r"\[[a-z ,]+\] datetime: \d{4}-\d\d-\d\d \d\d:\d\d:\d\d ", line), line
    assert [line.split("]")[0][1:] for line in stamps] == [
        "after megatron is initialized", "after model, optimizer, and learning rate scheduler are built",
        "after dataloaders are built", "before the start of training step", "after training is done"]
    order = [run.text.index(s) for s in ("end of arguments", "[after megatron is initialized]", "building GPT model",
                                         "[after model, optimizer", "> building train, validation",
                                         "[after dataloaders are built]", "training ...", " iteration        2/",
                                         "[after training is done]", "validation loss at the end of training")]
    assert order == sorted(order)


def test_iteration_line_has_megatrons_throughput_and_params_norm(run):
    line = next(x for x in run.lines if x.startswith(" iteration        2/"))
    fields = [f.strip() for f in line.split("|")]
    names = [f.split(":")[0] for f in fields if f]
    assert names[:4] == ["iteration        2/       4", "consumed samples", "elapsed time per iteration (ms)",
                         "throughput per GPU (TFLOP/s/GPU)"]
    assert names.index("params norm") == names.index("grad norm") + 1
    assert re.search(r" throughput per GPU \(TFLOP/s/GPU\): \d+\.\d \|", line)
    assert re.search(r" params norm: \d+\.\d{3} \|", line)
    assert float(re.search(r"params norm: (\S+)", line).group(1)) > 1.0


def test_wandb_gets_the_scalars_and_the_timers(run):
    w = run.wandb
    assert len(w.inits) == 1 and w.finished == 1
    assert (w.inits[0]["project"], w.inits[0]["name"]) == ("proj", "exp")
    assert w.inits[0]["dir"] == str(run.tmp / "ck" / "wandb")  # Megatron's default: --save/wandb
    by_step = {}
    for step, values in w.logged:
        by_step.setdefault(step, {}).update(values)
    assert sorted(by_step) == [2, 4]
    assert {"lm loss", "learning-rate", "grad-norm", "params-norm", "iteration-time", "throughput"} <= set(by_step[4])
    assert "lm loss validation" in by_step[4]
    assert 0 < by_step[4]["iteration-time"] < 60


def test_params_norm_is_the_norm_of_every_parameter():
    params = {"a": torch.randn(3, 4), "b": torch.randn(5)}
    trainer = SimpleNamespace(opt_params=params, pipeline=None, device=torch.device("cpu"),
                              parts=SimpleNamespace(dims=SimpleNamespace(pp=1, tp=1),
                                                    layout=SimpleNamespace(is_split=lambda name: False)))
    expected = torch.cat([p.flatten() for p in params.values()]).norm().item()
    assert interval_log.params_norm(trainer) == pytest.approx(expected, rel=1e-6)


def test_eta_honours_exit_duration_in_mins():
    train = SimpleNamespace(train_iters=1000, exit_duration_in_mins=1.0)
    trainer = SimpleNamespace(cfg=SimpleNamespace(train=train), iteration=10, run_start=time.perf_counter() - 30)
    eta, limited = interval_log.eta_seconds(trainer, ms_per_iter=1000.0)
    assert limited and 29 <= eta <= 31
    train.exit_duration_in_mins = 60.0
    assert interval_log.eta_seconds(trainer, 1000.0) == (990.0, False)
    assert metrics.throughput_suffix(10.0, 0.0, None, 30.0, "cpu", exit_limit=1.0) == \
        " tokens per GPU per second: 10 | ETA: 0:00:30 (--exit-duration-in-mins 1) |"


def _fails(capsys, argv) -> tuple[int, str, list[str]]:
    lines: list[str] = []
    code = train_main(RUN + ["--train-iters", "1"] + argv, log=lines.append).exit_code
    return code, capsys.readouterr().err.strip(), lines


def _one_line_before_the_model(code, err, lines, pattern):
    assert code == 2 and len(err.splitlines()) == 1 and re.search(pattern, err), err
    assert not any("building GPT model" in line for line in lines)


def test_data_path_suffixes_and_missing_data(tmp_path, capsys):
    for suffix in (".bin", ".idx"):
        prefix = f"{tmp_path}/my-gpt2_text_document"
        _one_line_before_the_model(*_fails(capsys, ["--data-path", prefix + suffix]),
                                   rf"give the prefix without \{suffix} \(--data-path {prefix}\)")
    _one_line_before_the_model(*_fails(capsys, ["--data-path", f"{tmp_path}/corpus.jsonl"]),
                               r"is raw text: preprocess it first \(gptrain preprocess --input .*corpus.jsonl "
                               r"--output-prefix .*corpus --append-eod\), then pass --data-path .*corpus_text_document")
    _one_line_before_the_model(*_fails(capsys, ["--data-path", "0.5", f"{tmp_path}/gone", "0.5", f"{tmp_path}/gone2"]),
                               r"--data-path: indexed dataset .*gone: .*gone.idx does not exist")


def test_unusable_save_and_load_are_reported_before_the_model(tmp_path, capsys, monkeypatch):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    mock = ["--mock-data"]
    _one_line_before_the_model(*_fails(capsys, mock + ["--save", str(a_file)]),
                               r"--save .*file is a file, not a folder")
    _one_line_before_the_model(*_fails(capsys, mock + ["--save", str(a_file / "ck")]),
                               r"--save .*ck cannot be created: .*file is a file")
    _one_line_before_the_model(*_fails(capsys, mock + ["--load", str(a_file)]), r"--load .*file is a file")
    _one_line_before_the_model(*_fails(capsys, mock + ["--load", str(tmp_path / "nothing")]),
                               r"--load .*nothing does not exist")
    readonly = tmp_path / "readonly"
    readonly.mkdir()
    real_access = startup.os.access
    monkeypatch.setattr(startup.os, "access",
                        lambda p, mode: False if str(p) == str(readonly) else real_access(p, mode))
    _one_line_before_the_model(*_fails(capsys, mock + ["--save", str(readonly)]), r"--save .*readonly is not writable")
    _one_line_before_the_model(*_fails(capsys, mock + ["--save", str(readonly / "ck")]),
                               r"--save .*ck cannot be created: .*readonly is not writable")


def test_exit_on_missing_checkpoint_is_megatrons_exit(tmp_path, capsys):
    empty = tmp_path / "ck"
    empty.mkdir()
    for argv in (["--load", str(tmp_path / "none")], ["--load", str(empty), "--save", str(empty)]):
        lines: list[str] = []
        result = train_main(RUN + ["--mock-data", "--train-iters", "1", "--exit-on-missing-checkpoint"] + argv,
                            log=lines.append)
        assert result.exit_code == 0 and result.iteration == 0
        assert lines[-1] == ">> '--exit-on-missing-checkpoint' set ... exiting. <<"
        assert not any("building GPT model" in line for line in lines)
    assert capsys.readouterr().err == ""


def test_wandb_not_installed_is_one_line(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # find_spec says: not importable
    real = startup.importlib.util.find_spec
    monkeypatch.setattr(startup.importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    _one_line_before_the_model(*_fails(capsys, ["--mock-data", "--wandb-project", "p"]),
                               r"^gptrain: error: --wandb-project needs the wandb package, which is not installed: "
                               r"pip install wandb")


@pytest.mark.slow
def test_params_norm_is_the_same_at_every_layout():
    """--log-params-norm counts shards once, replicas once and the tied output copy once: a TP2, PP2 or
    ZeRO-1 run prints one process's params norm."""
    from distributed import TINY, single, torchrun

    def norms(out: str) -> list[float]:
        return [float(x) for x in re.findall(r" params norm: (\S+) \|", out)]

    argv = TINY + ["--train-iters", "3", "--log-params-norm"]
    one = norms(single(argv))
    assert len(one) == 3
    for layout in (["--tensor-model-parallel-size", "2"], ["--pipeline-model-parallel-size", "2"],
                   ["--use-distributed-optimizer"]):
        assert norms(torchrun(2, argv + layout)) == pytest.approx(one, abs=1.5e-3), layout  # 3 decimals printed


def _check_on_rank(rank: int, tmp: str, out: str) -> None:
    import torch.distributed as dist

    from gptrain.config import parse_megatron_args
    from gptrain.train.startup import check_before_build_on_every_rank

    dist.init_process_group("gloo")
    bad = Path(tmp) / "a-file"
    save = str(bad) if rank == 1 else str(Path(tmp) / "ok")  # a node-local path that fails on one rank only
    cfg, _ = parse_megatron_args(["--mock-data", "--train-iters", "1", "--save", save], world_size=2)
    try:
        check_before_build_on_every_rank(cfg)
        message = "passed"
    except ValueError as err:
        message = str(err)
    (Path(out) / f"rank{rank}").write_text(message)
    dist.destroy_process_group()


@pytest.mark.slow
def test_a_start_up_check_failing_on_one_rank_stops_every_rank(tmp_path):
    from distributed import spawn

    (tmp_path / "a-file").write_text("not a folder")
    spawn(2, _check_on_rank, str(tmp_path), str(tmp_path))
    assert (tmp_path / "rank1").read_text() == f"--save {tmp_path / 'a-file'} is a file, not a folder: give a folder " \
                                               "for the checkpoints"
    assert (tmp_path / "rank0").read_text().startswith("a start-up check failed on another rank")
