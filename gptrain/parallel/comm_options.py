"""NCCL communicator options per mesh dimension, from Megatron-LM's two flags for them:
``--nccl-communicator-config-path`` (a YAML file: per group name, ``max_ctas``, ``min_ctas``,
``cga_cluster_size``, ``net_name``, ``is_high_priority_stream``) and ``--high-priority-stream-groups``.

Capping a group's CTAs leaves the rest of the SMs to the matmuls beside its collectives, so an
all-reduce issued beside compute (``--overlap-grad-reduce``'s buckets, a tensor-parallel layer's input
gradient) runs with it instead of waiting for its SMs (benchmarks/comm_overlap.py measures the trade).
Megatron's group names that have a mesh dimension here are tp, dp (dp_cp) and pp; its other groups
(context, expert, embedding ...) do not exist here, and their entries are noted and left out.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, fields, replace
from pathlib import Path

# Megatron-LM's communicator group names that have a mesh dimension here
GROUP_DIMS = {"tp": "tp", "dp": "dp", "dp_cp": "dp", "pp": "pp"}


@dataclass(frozen=True)
class CommOptions:
    """One communicator's NCCL options; None: NCCL's own default."""
    is_high_priority_stream: bool = False
    max_ctas: int | None = None
    min_ctas: int | None = None
    cga_cluster_size: int | None = None
    net_name: str | None = None

    def describe(self) -> str:
        parts = [f"{f.name} {getattr(self, f.name)}" for f in fields(self)
                 if f.name != "is_high_priority_stream" and getattr(self, f.name) is not None]
        return ", ".join((["high-priority stream"] if self.is_high_priority_stream else []) + parts)

    def nccl(self):
        """These options as ``ProcessGroupNCCL.Options`` (CUDA builds only)."""
        from torch.distributed import ProcessGroupNCCL

        options = ProcessGroupNCCL.Options(is_high_priority_stream=self.is_high_priority_stream)
        for name in ("max_ctas", "min_ctas", "cga_cluster_size", "net_name"):
            if getattr(self, name) is not None:
                setattr(options.config, name, getattr(self, name))
        return options


_KEYS = {f.name for f in fields(CommOptions)}
# NCCL's ncclConfig_t: CTAs per collective up to its channel count (64), a thread-block cluster of 0 (none) to 8
_RANGES = {"max_ctas": (1, 64), "min_ctas": (1, 64), "cga_cluster_size": (0, 8)}


def _checked(group: str, entry, where: str) -> CommOptions:
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: group {group!r} must map option names to values, got {entry!r}")
    unknown = sorted(map(str, set(entry) - _KEYS))
    if unknown:
        raise ValueError(f"{where}: group {group!r}: unknown option(s) {', '.join(unknown)} "
                         f"(known: {', '.join(sorted(_KEYS))})")
    for name, (low, high) in _RANGES.items():
        value = entry.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high):
            raise ValueError(f"{where}: group {group!r}: {name} must be a whole number from {low} to {high} "
                             f"(NCCL's range), got {value!r}")
    if entry.get("min_ctas") and entry.get("max_ctas") and entry["min_ctas"] > entry["max_ctas"]:
        raise ValueError(f"{where}: group {group!r}: min_ctas {entry['min_ctas']} is above max_ctas {entry['max_ctas']}")
    net = entry.get("net_name")
    if net is not None and str(net).lower() not in ("ib", "socket"):
        raise ValueError(f"{where}: group {group!r}: net_name {net!r} is not supported (IB or Socket, as in Megatron-LM)")
    priority = entry.get("is_high_priority_stream", False)
    if not isinstance(priority, bool):
        raise ValueError(f"{where}: group {group!r}: is_high_priority_stream must be true or false, got {priority!r}")
    return CommOptions(**entry)


def read_config(path: str) -> tuple[dict[str, CommOptions], list[str]]:
    """The file's options by Megatron group name (those gptrain has), and the names it left out."""
    import yaml

    where = f"--nccl-communicator-config-path {path}"
    if not Path(path).is_file():
        raise ValueError(f"{where}: no such file")
    try:
        loaded = yaml.safe_load(Path(path).read_text())
    except yaml.YAMLError as e:
        raise ValueError(f"{where}: not valid YAML ({str(e).splitlines()[0]})") from None
    except (OSError, UnicodeError) as e:
        raise ValueError(f"{where}: cannot be read ({e})") from None
    if loaded is None:
        return {}, []
    if not isinstance(loaded, dict):
        raise ValueError(f"{where}: the file must map group names (tp, dp, pp ...) to their options")
    known = {str(g): _checked(str(g), e, where) for g, e in loaded.items() if str(g) in GROUP_DIMS}
    return known, [str(g) for g in loaded if str(g) not in GROUP_DIMS]


def comm_options(config_path: str | None, high_priority_groups: list[str]) -> tuple[dict[str, CommOptions], list[str]]:
    """Per mesh dimension, its communicator's options (dimensions with NCCL's defaults left out), and the
    group names of the file that have no group here. ``--high-priority-stream-groups`` adds the high-priority
    stream to its groups' entries, as Megatron-LM merges the two."""
    unknown = [n for n in high_priority_groups if n not in GROUP_DIMS]
    if unknown:
        raise ValueError(f"--high-priority-stream-groups {' '.join(unknown)}: gptrain's groups are tp, dp (dp_cp) "
                         "and pp (no context or expert parallelism)")
    by_group, ignored = read_config(config_path) if config_path else ({}, [])
    if "dp" in by_group and "dp_cp" in by_group and by_group["dp"] != by_group["dp_cp"]:
        # one group here (no context parallelism); Megatron reduces the gradients over dp_cp, so its entry wins
        del by_group["dp"]
        ignored.append("dp (dp_cp's options taken: one group here)")
    by_dim = {GROUP_DIMS[name]: options for name, options in by_group.items()}
    for dim in (GROUP_DIMS[n] for n in high_priority_groups):
        by_dim[dim] = replace(by_dim.get(dim, CommOptions()), is_high_priority_stream=True)
    return {d: o for d, o in by_dim.items() if o != CommOptions()}, ignored


def describe(options: dict[str, CommOptions], ignored: list[str], device_type: str) -> str:
    """The log's line for the communicators' options."""
    line = " > NCCL communicators: " + ("; ".join(f"{dim} {o.describe()}" for dim, o in options.items())
                                         or "NCCL's defaults")
    if ignored:
        line += f" (no group here for {', '.join(ignored)}: left out)"
    if device_type != "cuda":
        return line + " (no effect here: gloo has no CUDA streams or CTAs)"
    if (any(o.is_high_priority_stream for o in options.values())
            and os.environ.get("CUDA_GRAPHS_USE_NODE_PRIORITY") != "1"):
        line += " (a high-priority stream inside CUDA graphs, tensor parallelism's default, only with " \
                "CUDA_GRAPHS_USE_NODE_PRIORITY=1 set)"
    return line
