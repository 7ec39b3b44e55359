"""examples/: every training script parses and validates for its world size, launching nothing.

Each script honours GPTRAIN_LAUNCH (default: its real launcher, torchrun or python3) and passes "$@"
through, so running it with GPTRAIN_LAUNCH=<this python> and ``--dry-run --world-size N`` makes it run
``python -m gptrain train <its flags> --dry-run --world-size N``: every flag parsed, the layout checked,
each model-parallel rank's parameter count printed, no data read, no GPU needed. The SLURM file runs
with stub ``srun``/``scontrol``/``torchrun`` commands on PATH that turn its torchrun line into the same
dry run. All the dry runs start together (one process each) and the tests read their results.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"


@dataclass(frozen=True)
class Case:
    script: str
    world: int
    tp: int
    pp: int
    padded_vocab: int
    # parameters per (tensor, pipeline) rank: by pipeline stage (same on every tensor rank)
    stage_params: tuple[int, ...] | None = None
    extra: tuple[str, ...] = ()
    env: dict = field(default_factory=dict, hash=False, compare=False)

    @property
    def dp(self) -> int:
        return self.world // (self.tp * self.pp)

    @property
    def id(self) -> str:
        return self.script + "".join(f" {x}" for x in self.extra) + f" @{self.world}"


SEED_345M_1GPU = 354871296  # seeds/000 and seeds/004, Megatron's count on one GPU
CASES = [
    Case("pretrain_gpt_345m_1gpu.sh", 1, 1, 1, 50304, (SEED_345M_1GPU,)),
    Case("pretrain_gpt_345m_4gpu_dp.sh", 4, 1, 1, 50304, (SEED_345M_1GPU,)),  # seeds/004 4DP
    Case("pretrain_gpt_345m_4gpu_tp2_dp2.sh", 4, 2, 1, 50432, (178100224,)),
    Case("pretrain_gpt_345m_4gpu_tp2_pp2.sh", 4, 2, 2, 50432, (102483968, 101437440)),  # seeds/004
    Case("pretrain_gpt_345m_4gpu_tp4.sh", 4, 4, 1, 50688, (89714688,)),  # seeds/004
    Case("pretrain_gpt_345m_4gpu_pp4.sh", 4, 1, 4, 50304, (128137216, 75577344, 75577344, 127090688)),  # seeds/004
    # the seed's layout on its 4 GPUs: TP 4, one data-parallel rank, ZeRO-3 with CPU offload (ZeRO-Offload)
    Case("pretrain_gpt_345m_deepspeed_zero3.sh", 4, 4, 1, 50688, (89714688,)),
    Case("pretrain_gpt_345m_deepspeed_zero3.sh", 8, 4, 1, 50688, (89714688,), env={"N_GPUS": "8"}),
    # issue 32's Llama-style models (no seed): 16 x 45092864 in the blocks + embeddings and untied output layer
    Case("pretrain_llama_1b.sh", 1, 1, 1, 50304, (927533056,)),
    Case("pretrain_llama_4gpu.sh", 4, 2, 2, 50432, (782192640, 782195712)),  # ~3B, TP2+SP x PP2
    Case("pretrain_gpt3_175b_64gpu.sh", 64, 8, 8, 51200),
    Case("pretrain_gpt3_175b_64gpu.sbatch", 64, 8, 8, 51200),
]

SLURM_STUBS = {
    "srun": 'exec "$@"\n',
    "scontrol": '[ "$1 $2" = "show hostnames" ] || exit 3\necho node001\necho node002\n',
    # record the torchrun line, then run what follows -m as a plain dry run
    "torchrun": 'echo "torchrun $*" >&2\nwhile [ "$#" -gt 0 ] && [ "$1" != "-m" ]; do shift; done\n'
                'exec "$GPTRAIN_PYTHON" "$@"\n',
}


def _base_env(tmp: Path) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "VOCAB_FILE",
                        "MERGE_FILE", "DATA_PATH", "DATASET", "DATASET_PATH", "DATASETCACHE", "CHECKPOINT_PATH",
                        "TENSORBOARD_LOGS_PATH", "CONFIG_JSON", "N_GPUS", "EXAMPLES_DIR", "GPTRAIN_LAUNCH")
           and not k.startswith("SLURM_")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    env["GPTRAIN_LAUNCH"] = sys.executable  # python3 that has gptrain and torch
    env["DATA_PATH"] = str(tmp / "no-such-data_text_document")  # a dry run reads no data
    return env


def _run(case: Case, tmp: Path) -> subprocess.CompletedProcess:
    env = _base_env(tmp) | case.env
    if case.script.endswith(".sbatch"):
        stubs = tmp / "slurm-stubs"
        stubs.mkdir(exist_ok=True)
        for name, body in SLURM_STUBS.items():
            (stubs / name).write_text("#!/bin/bash\n" + body)
            (stubs / name).chmod(0o755)
        env |= {"PATH": f"{stubs}{os.pathsep}{env['PATH']}", "GPTRAIN_PYTHON": sys.executable,
                "SLURM_JOB_NODELIST": "node[001-008]", "SLURM_NNODES": "8", "SLURM_JOB_ID": "4242",
                "SLURM_SUBMIT_DIR": str(REPO)}
    cwd = tmp / "cwd"  # relative default paths land here if anything were written
    cwd.mkdir(exist_ok=True)
    argv = ["bash", str(EXAMPLES / case.script), *case.extra, "--dry-run", "--world-size", str(case.world)]
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def dry_runs(tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    cases = CASES
    tmps = [tmp_path_factory.mktemp("example") for _ in cases]
    with ThreadPoolExecutor(max_workers=len(cases)) as pool:
        results = list(pool.map(_run, cases, tmps))
    for tmp in tmps:  # the dry run created nothing
        assert [p.name for p in (tmp / "cwd").iterdir()] == [], f"a dry run wrote into {tmp / 'cwd'}"
    return {case.id: result for case, result in zip(cases, results)}


def _per_rank_counts(stdout: str) -> dict[tuple[int, int], int]:
    pattern = r"^ > number of parameters on \(tensor, pipeline\) model parallel rank \((\d+), (\d+)\): (\d+)$"
    found = re.findall(pattern, stdout, flags=re.M)
    counts = {(int(t), int(p)): int(n) for t, p, n in found}
    assert len(counts) == len(found), "a rank printed twice"
    return counts


@pytest.mark.slow  # the fast loop (-m "not slow") stays under 3 minutes; CI runs it
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_example_dry_run(case: Case, dry_runs):
    result = dry_runs[case.id]
    out = result.stdout
    assert result.returncode == 0, f"{case.script} exited {result.returncode}:\n{result.stderr}\n{out}"
    assert "gptrain: error" not in result.stderr
    assert (f"using world size: {case.world}, data-parallel-size: {case.dp}, tensor-model-parallel size: "
            f"{case.tp}, pipeline-model-parallel size: {case.pp}") in out
    assert re.search(rf"^ > padded vocab \(size: 50257\) with \d+ dummy tokens \(new size: {case.padded_vocab}\)$",
                     out, flags=re.M), out
    counts = _per_rank_counts(out)
    assert set(counts) == {(t, p) for t in range(case.tp) for p in range(case.pp)}, counts
    if case.stage_params is not None:
        assert counts == {(t, p): case.stage_params[p] for t in range(case.tp) for p in range(case.pp)}
    if case.script.startswith("pretrain_gpt3_175b"):
        assert len(counts) == 64
        # 175B split over 64 ranks: the sum over the 8 stages of one tensor rank, times 8, is the model
        total = sum(counts.values())
        assert 174e9 < total < 176e9, total
        # the seed's ramp-up and sample-based schedule, passed as written
        assert ("will use batch size rampup starting from global batch size 16 to global batch size 1536 with "
                "batch size increments 16 over 433870 samples.") in out


@pytest.mark.slow  # the fast loop (-m "not slow") stays under 3 minutes; CI runs it
def test_sbatch_launches_torchrun_with_rendezvous_on_first_node(dry_runs):
    result = dry_runs[next(c.id for c in CASES if c.script.endswith(".sbatch"))]
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("torchrun ")]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("torchrun --nnodes 8 --nproc_per_node 8 --max-restarts 3 --rdzv-id 4242 --rdzv-backend c10d "
                               "--rdzv-endpoint node001:29500 -m gptrain train --num-layers 96 "), lines[0]
    assert lines[0].endswith(" --dry-run --world-size 64")
    sbatch = (EXAMPLES / "pretrain_gpt3_175b_64gpu.sbatch").read_text()
    for directive in ("#SBATCH --nodes=8", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=8", "#SBATCH --requeue"):
        assert directive in sbatch


TORCHRUN_1x4 = "--nproc_per_node 4 --nnodes 1"
DEFAULT_LAUNCH = {
    "pretrain_gpt_345m_1gpu.sh": "python3 -m gptrain train ",
    "pretrain_gpt_345m_4gpu_dp.sh": f"torchrun {TORCHRUN_1x4} --master_addr localhost --master_port 6000 -m gptrain train ",
    **{f"pretrain_gpt_345m_4gpu_{layout}.sh":
       f"torchrun {TORCHRUN_1x4} --node_rank 0 --master_addr localhost --master_port 6000 -m gptrain train "
       for layout in ("tp2_dp2", "tp2_pp2", "tp4", "pp4")},
    "pretrain_gpt_345m_deepspeed_zero3.sh": "torchrun --nproc_per_node 4 -m gptrain train ",
    "pretrain_llama_1b.sh": "python3 -m gptrain train ",
    "pretrain_llama_4gpu.sh": f"torchrun {TORCHRUN_1x4} --node_rank 0 --master_addr localhost --master_port 6000 "
                              "-m gptrain train ",
    "pretrain_gpt3_175b_64gpu.sh": "torchrun --nnodes 8 --nproc_per_node 8 --rdzv-backend c10d "
                                   "--rdzv-endpoint 10.0.0.1:6000 -m gptrain train ",
}


@pytest.mark.parametrize("script", sorted(DEFAULT_LAUNCH))
def test_example_default_launcher(script, tmp_path):
    """Without GPTRAIN_LAUNCH a script starts its real launcher (stubs here that only print their line)."""
    for name in ("torchrun", "python3"):
        (tmp_path / name).write_text(f'#!/bin/bash\necho "LAUNCHED {name} $*"\n')
        (tmp_path / name).chmod(0o755)
    env = _base_env(tmp_path)
    del env["GPTRAIN_LAUNCH"]
    env |= {"PATH": f"{tmp_path}{os.pathsep}{env['PATH']}", "MASTER_ADDR": "10.0.0.1"}
    if script != "pretrain_gpt3_175b_64gpu.sh":
        del env["MASTER_ADDR"]  # the single-node scripts default to localhost
    result = subprocess.run(["bash", str(EXAMPLES / script), "--extra-flag"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    launched = [line for line in result.stdout.splitlines() if line.startswith("LAUNCHED ")]
    assert len(launched) == 1, result.stdout
    assert launched[0].startswith("LAUNCHED " + DEFAULT_LAUNCH[script]), launched[0]
    assert launched[0].endswith(" --extra-flag")


def test_deepspeed_config_is_the_seeds():
    assert json.loads((EXAMPLES / "deepspeed_config.json").read_text()) == {
        "fp16": {"enabled": True},
        "zero_optimization": {"stage": 3, "allgather_partitions": True, "allgather_bucket_size": 2e8,
                              "overlap_comm": True, "reduce_scatter": True, "reduce_bucket_size": 2e8,
                              "contiguous_gradients": True, "cpu_offload": True},
    }


# the 175B seed's two flags that change nothing here: accepted with a note, and passed by the example
NO_OP_SEED_FLAGS = ["--use-flash-attn-v2", "--log-validation-ppl-to-tensorboard"]


@pytest.mark.parametrize("flag", NO_OP_SEED_FLAGS)
def test_the_175b_seeds_no_op_flags_are_passed_and_noted(flag):
    from gptrain.config import parse_megatron_args

    _, notes = parse_megatron_args(["--mock-data", "--train-iters", "1", flag], world_size=1)
    assert any(note.startswith(flag) for note in notes), notes
    documented = (EXAMPLES / "gpt3_175b_flags.sh").read_text()
    assert flag in "\n".join(line for line in documented.splitlines() if not line.lstrip().startswith("#"))


@pytest.mark.parametrize("script", sorted(p.name for p in EXAMPLES.iterdir() if p.suffix in (".sh", ".sbatch")))
def test_example_header(script):
    """Each script says where it comes from and what machine it needs, and passes "$@" through."""
    text = (EXAMPLES / script).read_text()
    head = text.split("\nset -eo pipefail", 1)[0] if "set -eo pipefail" in text else text
    assert re.search(r"^# Seed: +(seeds/00\d|none -- issue \d+)", head, flags=re.M), f"{script}: no '# Seed:' line"
    if script != "gpt3_175b_flags.sh":  # sourced by the two 175B launchers, which name the machine
        assert re.search(r"^# Machine: ", head, flags=re.M), f"{script}: no '# Machine:' line"
        assert re.search(r'"\$@"\s*$', text), f"{script}: the launch line must end with \"$@\""
    assert subprocess.run(["bash", "-n", str(EXAMPLES / script)]).returncode == 0
