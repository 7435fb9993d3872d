"""Checkpoints through orbax's CheckpointManager: async writes, the last ``keep`` kept, each one
committed atomically (orbax writes a temporary directory and renames it when complete, so an
interrupted write leaves the previous checkpoint as the latest restorable one).

A checkpoint holds the training state (restored straight into the run's shardings) and the data
iterator's position (JSON), so a resumed run continues the exact sample order."""
from __future__ import annotations

import os
from typing import Optional

import jax
import orbax.checkpoint as ocp


class Checkpoints:
    def __init__(self, directory: str, keep: int, async_write: bool = True):
        self.dir = os.path.abspath(directory)
        self.mngr = ocp.CheckpointManager(
            self.dir, options=ocp.CheckpointManagerOptions(
                max_to_keep=keep, enable_async_checkpointing=async_write, create=True))

    def latest(self) -> Optional[int]:
        return self.mngr.latest_step()

    def save(self, step: int, state, data_state: dict, force: bool = False) -> None:
        """Starts the write (async); training continues while it completes."""
        self.mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                     data=ocp.args.JsonSave(data_state)),
                       force=force)

    def restore(self, step: int, like_state) -> tuple[dict, dict]:
        """The state at ``step`` placed like ``like_state`` (same shapes, dtypes, shardings)."""
        target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                              like_state)
        out = self.mngr.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(target), data=ocp.args.JsonRestore()))
        return out["state"], out["data"]

    def restore_newest_good(self, like_state) -> tuple[dict, dict, int]:
        """(state, data position, step) of the newest checkpoint that restores. A checkpoint
        that fails (a truncated or corrupted file) is reported, deleted and skipped, so training
        resumes from the one before it instead of dying."""
        import sys
        for step in sorted(self.mngr.all_steps(), reverse=True):
            try:
                state, data = self.restore(step, like_state)
                return state, data, step
            except Exception as e:  # noqa: BLE001 - any failure to read this step
                reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
                print(f"warning: checkpoint step {step} in {self.dir} does not restore "
                      f"({type(e).__name__}: {reason}); deleting it and trying the one before",
                      file=sys.stderr)
                self.mngr.delete(step)
        raise ValueError(f"no checkpoint in {self.dir} restores; move the directory away and "
                         f"start the run again")

    def wait(self) -> None:
        self.mngr.wait_until_finished()

    def close(self) -> None:
        self.mngr.close()
