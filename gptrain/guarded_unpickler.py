"""The base of gptrain's restricted unpicklers (DCP metadata, Megatron's torch.save files): Python's own
unpickler, so that one opcode can be checked, with BUILD refused on a class or a function.

An allow-list in ``find_class`` decides which globals a file may name; but pickle's BUILD opcode sets
state on whatever object is below it, and on an allowed class or function that state would outlive the
file (``BUILD`` on ``pathlib.PurePosixPath`` can make its ``name`` a constant for the whole process).
Instances that the file's own REDUCE and NEWOBJ make may still take state: that is how pickle restores
them. No persistent ids unless a subclass reads them.
"""
from __future__ import annotations

import pickle
import types

_UNTOUCHABLE = (type, types.FunctionType, types.BuiltinFunctionType, types.MethodType)


class GuardedUnpickler(pickle._Unpickler):
    error = pickle.UnpicklingError  # what a refusal raises (subclasses name their own)

    dispatch = dict(pickle._Unpickler.dispatch)

    def __init__(self, file, path):
        super().__init__(file)
        self._path = path

    def load_build(self):
        if len(self.stack) > 1 and isinstance(self.stack[-2], _UNTOUCHABLE):
            raise self.error(f"{self._path}: refuses to set state on {self.stack[-2]!r:.80}: a checkpoint's "
                             "pickle may build its own objects only")
        super().load_build()

    dispatch[pickle.BUILD[0]] = load_build

    def persistent_load(self, pid):
        raise self.error(f"{self._path}: refuses persistent id {pid!r:.80}")
