"""--load of a bf16 Megatron-LM run saved at tensor parallel 2, and one saved at pipeline parallel 2, with the
distributed optimizer in its default dp_reshardable format: megatron-core itself trains and saves in two
gloo processes (tests/megatron_core_optim.py; PP2 through its 1F1B schedule), each model-parallel rank's
flat buffers under its own dp_group_idx holding that rank's shards or stage. gptrain (one process) imports
the fp32 main weights, moments and step equal to megatron-core's per-rank state joined (by the parameters'
own partition dims, stage-local layers numbered globally), and its next iteration gives megatron-core's
next main weights within the bf16 test's tolerances (the two tests below are test_megatron_optim_bf16.py's,
run on these checkpoints)."""
from __future__ import annotations

import pytest

from test_megatron_optim import RUN, _megatron_core_run
from test_megatron_optim_bf16 import (test_main_weights_moments_and_step_are_megatron_cores,  # noqa: F401
                                      test_training_continues_as_megatron_core_would)

# at TP2 Megatron pads the vocabulary to a multiple of 64 x TP here: the 1152 rows a one-process gptrain run
# has, so --softmax-over-padded-vocab sums over the rows megatron-core's loss did
LAYOUTS = {"tp2": ({"tp": 2, "model": {**RUN["model"], "make_vocab_size_divisible_by": 64}}, "TP2 x PP1"),
           "pp2": ({"pp": 2}, "TP1 x PP2")}


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def bf16_run(request, tmp_path_factory):
    run, layout = LAYOUTS[request.param]
    folder = _megatron_core_run(tmp_path_factory.mktemp(f"distopt_{request.param}"), precision="bf16",
                                distributed="dp_reshardable", **run)
    return folder, f"distributed optimizer, dp_reshardable, {layout}"


def test_each_model_parallel_rank_has_its_own_buffers(bf16_run):
    from gptrain.train.safe_dcp import read_metadata_safely

    folder, _ = bf16_run
    keys = read_metadata_safely(folder / "iter_0000002", allow_bytes=True).state_dict_metadata
    groups = {k.split(".")[2] for k in keys if k.startswith("optimizer.distributed.") and k.endswith(".exp_avg")}
    assert groups == {"dp_group_idx_0", "dp_group_idx_1"}
