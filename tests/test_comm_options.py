"""Megatron-LM's NCCL communicator flags: --nccl-communicator-config-path's YAML (per group: max_ctas, min_ctas,
cga_cluster_size, net_name, is_high_priority_stream) and --high-priority-stream-groups, merged as Megatron
merges them onto the mesh's dimensions; every bad entry refused in one line; a data-parallel run with them
equal to one process (gloo: no effect on the numbers)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from distributed import TINY, losses, single, torchrun
from gptrain.config import parse_megatron_args
from gptrain.parallel.comm_options import CommOptions, comm_options, describe
from gptrain.train.build import parallel_dims

# a Megatron user's file: groups gptrain has (tp, dp_cp, pp) and one it has not (cp)
MEGATRON_YAML = """\
tp:
  max_ctas: 16
  cga_cluster_size: 2
dp_cp:
  max_ctas: 8
  min_ctas: 4
pp:
  net_name: IB
cp:
  max_ctas: 4
"""


def _config(tmp_path, text: str) -> str:
    path = tmp_path / "nccl.yaml"
    path.write_text(text)
    return str(path)


def test_the_file_maps_megatron_group_names_onto_mesh_dimensions(tmp_path):
    options, ignored = comm_options(_config(tmp_path, MEGATRON_YAML), [])
    assert options == {"tp": CommOptions(max_ctas=16, cga_cluster_size=2), "dp": CommOptions(max_ctas=8, min_ctas=4),
                       "pp": CommOptions(net_name="IB")}
    assert ignored == ["cp"]
    assert describe(options, ignored, "cuda") == (
        " > NCCL communicators: tp max_ctas 16, cga_cluster_size 2; dp max_ctas 8, min_ctas 4; pp net_name IB "
        "(no group here for cp: left out)")


def test_high_priority_groups_merge_into_the_file_as_in_megatron(tmp_path, monkeypatch):
    monkeypatch.delenv("CUDA_GRAPHS_USE_NODE_PRIORITY", raising=False)
    options, _ = comm_options(_config(tmp_path, "tp:\n  max_ctas: 16\n"), ["tp", "dp_cp", "pp"])
    assert options == {"tp": CommOptions(is_high_priority_stream=True, max_ctas=16),
                       "dp": CommOptions(is_high_priority_stream=True), "pp": CommOptions(is_high_priority_stream=True)}
    line = describe(options, [], "cuda")
    assert line.startswith(" > NCCL communicators: tp high-priority stream, max_ctas 16; dp high-priority stream; ")
    assert "only with CUDA_GRAPHS_USE_NODE_PRIORITY=1 set" in line
    assert describe({"tp": CommOptions(max_ctas=16)}, [], "cpu").endswith("(no effect here: gloo has no CUDA streams "
                                                                          "or CTAs)")
    # without either flag nothing changes: NCCL's defaults, no communicator of its own
    assert comm_options(None, []) == ({}, [])
    assert comm_options(_config(tmp_path, "tp:\n  is_high_priority_stream: false\n"), []) == ({}, [])


@pytest.mark.parametrize("text,message", [
    ("tp:\n  max_cta: 8\n", "group 'tp': unknown option(s) max_cta (known: cga_cluster_size, "
                            "is_high_priority_stream, max_ctas, min_ctas, net_name)"),
    ("tp:\n  max_ctas: 0\n", "group 'tp': max_ctas must be a whole number from 1 to 64 (NCCL's range), got 0"),
    ("tp:\n  max_ctas: 1000\n", "max_ctas must be a whole number from 1 to 64 (NCCL's range), got 1000"),
    ("dp:\n  max_ctas: eight\n", "group 'dp': max_ctas must be a whole number from 1 to 64 (NCCL's range), got 'eight'"),
    ("pp:\n  cga_cluster_size: 9\n", "cga_cluster_size must be a whole number from 0 to 8"),
    ("tp:\n  1: 2\n  foo: 3\n", "unknown option(s) 1, foo"),
    ("tp:\n  min_ctas: 16\n  max_ctas: 8\n", "group 'tp': min_ctas 16 is above max_ctas 8"),
    ("pp:\n  net_name: nvlink\n", "net_name 'nvlink' is not supported (IB or Socket, as in Megatron-LM)"),
    ("tp:\n  is_high_priority_stream: yes please\n", "is_high_priority_stream must be true or false"),
    ("tp: 16\n", "group 'tp' must map option names to values, got 16"),
    ("- tp\n- dp\n", "the file must map group names (tp, dp, pp ...) to their options"),
    ("tp: [max_ctas\n", "not valid YAML"),
])
def test_a_bad_file_is_refused_in_one_line(tmp_path, text, message):
    with pytest.raises(ValueError, match="--nccl-communicator-config-path") as e:
        comm_options(_config(tmp_path, text), [])
    assert message in str(e.value) and "\n" not in str(e.value)


def test_dp_cp_wins_over_dp_and_a_cluster_of_zero_is_nccls_none(tmp_path):
    """Megatron reduces the gradients over dp_cp; here dp and dp_cp are one group (no context parallelism)."""
    options, ignored = comm_options(_config(tmp_path, "dp:\n  max_ctas: 8\ndp_cp:\n  max_ctas: 16\n"
                                                      "tp:\n  cga_cluster_size: 0\n"), [])
    assert options == {"dp": CommOptions(max_ctas=16), "tp": CommOptions(cga_cluster_size=0)}
    assert ignored == ["dp (dp_cp's options taken: one group here)"]
    assert comm_options(_config(tmp_path, "dp:\n  max_ctas: 8\ndp_cp:\n  max_ctas: 8\n"), []) == \
        ({"dp": CommOptions(max_ctas=8)}, [])


def test_a_missing_or_unreadable_file_and_an_unknown_group_are_refused(tmp_path):
    with pytest.raises(ValueError, match="no such file"):
        comm_options(str(tmp_path / "absent.yaml"), [])
    (tmp_path / "latin1.yaml").write_bytes(b"tp:\n  net_name: \xe9\n")
    with pytest.raises(ValueError, match="cannot be read"):
        comm_options(str(tmp_path / "latin1.yaml"), [])
    with pytest.raises(ValueError, match="--high-priority-stream-groups cp ep: gptrain's groups are tp, dp"):
        comm_options(None, ["tp", "cp", "ep"])


def test_the_flags_reach_the_layout(tmp_path):
    argv = TINY + ["--train-iters", "1", "--nccl-communicator-config-path", _config(tmp_path, MEGATRON_YAML),
                   "--high-priority-stream-groups", "dp"]
    cfg, _ = parse_megatron_args(argv, world_size=2)
    dims = parallel_dims(cfg, 2)
    assert dict(dims.comm) == {"tp": CommOptions(max_ctas=16, cga_cluster_size=2),
                               "dp": CommOptions(is_high_priority_stream=True, max_ctas=8, min_ctas=4),
                               "pp": CommOptions(net_name="IB")}
    assert dims.comm_ignored == ("cp",)


@pytest.mark.slow
def test_data_parallel_with_communicator_options_equals_one_process(tmp_path):
    """On gloo the options change nothing: the run is the one-process run, and its log says so."""
    steps = ["--train-iters", "3"]
    ref = losses(single(TINY + steps))
    out = torchrun(2, TINY + steps + ["--nccl-communicator-config-path", _config(tmp_path, MEGATRON_YAML)])
    got = losses(out)
    assert sorted(got) == [1, 2, 3]
    assert all(got[i] == pytest.approx(ref[i], rel=1e-5) for i in ref)
    assert " > NCCL communicators: tp max_ctas 16, cga_cluster_size 2; dp max_ctas 8, min_ctas 4; pp net_name IB " \
           "(no group here for cp: left out) (no effect here: gloo has no CUDA streams or CTAs)" in out


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and dist.is_nccl_available()), reason="needs NCCL (the GPU lane)")
def test_the_options_become_nccl_options():
    options = CommOptions(is_high_priority_stream=True, max_ctas=16, min_ctas=2, cga_cluster_size=2,
                          net_name="Socket").nccl()
    assert options.is_high_priority_stream
    assert (options.config.max_ctas, options.config.min_ctas, options.config.cga_cluster_size) == (16, 2, 2)
    assert options.config.net_name == "Socket"


def test_build_mesh_gives_each_named_dimension_its_own_communicator(monkeypatch):
    import gptrain.parallel.dims as dims_module
    from gptrain.parallel.dims import ParallelDims

    seen = {}
    monkeypatch.setattr(dims_module, "init_device_mesh", lambda device, shape, mesh_dim_names, **kw: seen.update(kw))
    monkeypatch.setattr(dims_module.dist, "get_backend", lambda: "nccl")
    monkeypatch.setattr(CommOptions, "nccl", lambda self: ("NCCL options", self.max_ctas))  # a CPU build has no NCCL
    dims = ParallelDims(world_size=4, tp=2, comm=(("tp", CommOptions(max_ctas=16)), ("dp", CommOptions(max_ctas=8))))
    dims.build_mesh("cuda")
    assert seen == {"backend_override": {"tp": ("cpu:gloo,cuda:nccl", ("NCCL options", 16)),
                                         "dp": ("cpu:gloo,cuda:nccl", ("NCCL options", 8))}}
    seen.clear()
    dims.build_mesh("cpu")  # gloo: the default groups
    assert seen == {}
