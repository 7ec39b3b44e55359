"""The trainer's resume from a checkpoint folder: gptrain's own (DCP), Megatron-LM's (legacy or
torch_dist, with its optimizer state where gptrain reads it) or a Hugging Face GPT-2 folder; which
folder (``--load`` or ``--save``'s newest) is train/resume.py's choice. ``Trainer`` inherits these
methods: the counters, optimizer and schedule they restore are the trainer's own."""
from __future__ import annotations

import time

from gptrain.checkpoint_kind import checkpoint_kind
from gptrain.train import restart_note, resume
from gptrain.train.checkpoint import load_checkpoint
from gptrain.train.checkpoint_files import find_gptrain_iteration_dir, recover
from gptrain.train.megatron_load import load_hf, load_megatron


class CheckpointLoading:
    def load(self) -> None:
        """Resume (train/resume.py decides from which folder), then refuse a --save holding newer
        checkpoints of another run."""
        t = self.cfg.train
        kinds = {r: checkpoint_kind(r, none_ok=True) for r in (t.save, t.load) if r}  # None: none there yet
        for root in (r for r, kind in kinds.items() if kind in ("gptrain", None)):
            recover(root, self.log)  # put back what a killed save moved aside, drop its temporary files
        load = resume.load_folder(t.load, t.save, self.log)
        began = time.perf_counter()
        self._load(load, kinds.get(load, "gptrain") if load else None)
        line = restart_note.resume_line(t.save, self.loaded_iteration, time.perf_counter() - began if load else None)
        if line:
            self.log(line)
        resume.refuse_overwriting(t.save, load, 0 if t.finetune else self.iteration)

    def _load(self, load: str | None, kind: str | None) -> None:
        t = self.cfg.train
        if not load:
            return
        if kind == "megatron":
            self._load_megatron()
            return
        if kind == "huggingface":  # a Hugging Face GPT-2 folder: weights only
            load_hf(load, self.opt_params, self.cfg, self.parts.layout)
            if self.main is not None:
                self.main.copy_to_model()
            self.log(f"  loaded Hugging Face weights from {load}; iteration 0, optimizer state starts fresh")
            return
        path = find_gptrain_iteration_dir(load, self.log)
        if path is None:
            raise ValueError(f"--load {load} holds no checkpoint")
        resume.check_saved_config(path, self.cfg)
        state = load_checkpoint(load, self.opt_params, None if (t.no_load_optim or t.finetune) else self.optimizer,
                                self.cfg.model.vocab_size, load_rng=not (t.no_load_rng or t.finetune), log=self.log,
                                layout=self.parts.layout, path=path)
        if self.main is not None:
            self.main.copy_to_model()
        if t.finetune:
            self.log(f" loaded weights from {load} (iteration {state['iteration']}); --finetune starts at 0")
            return
        self.progress.load_state_dict(state)
        self.loaded_iteration = self.iteration
        if t.no_load_optim:  # Megatron's meaning: the scheduler and loss scaler go with the optimizer
            self.log(" > --no-load-optim: optimizer state, learning-rate schedule and loss scale start fresh")
        else:  # the other parts; one the checkpoint has none of (a bf16 run's loss scaler) starts fresh
            for name, part in self.stateful.items():
                if part is not self.progress and part and state.get(name):
                    part.load_state_dict(state[name])
        self.log(f"  successfully loaded checkpoint from {load} at iteration {self.iteration}")

    def _load_megatron(self) -> None:
        t = self.cfg.train  # Megatron's --no-load-optim: the schedule goes with the optimizer
        optimizer = None if (t.finetune or t.no_load_optim) else self.optimizer
        state = load_megatron(t.load, self.opt_params, self.cfg, self.parts.layout, optimizer, self.schedule)
        if self.main is not None:
            self.main.copy_to_model()
        self.log(f"  loaded Megatron-LM checkpoint from {t.load} at iteration {state['iteration']} ({state['layout']}); "
                 + state["optimizer"])
        if t.finetune or state["iteration"] == "release":
            return
        self.progress.load_state_dict(state)
        self.loaded_iteration = self.iteration  # Megatron's schedule counts samples, as gptrain's does
        self.schedule.num_steps = int(state["scheduler"]["num_steps"]) if state["scheduler"] else self.consumed_train
        if state["loss_scale"] and self.scaler is not None:  # Megatron's DynamicGradScaler, where it continues
            self.scaler.load_state_dict(state["loss_scale"])
