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

    @property
    def quarantine_dir(self) -> str:
        """Where checkpoints that do not restore are moved (beside the checkpoints, out of
        orbax's sight): kept as evidence, never deleted."""
        return self.dir + ".quarantine"

    def _unreadable(self, step: int) -> Optional[str]:
        """A file of this step that this process cannot read (a run copied from another user,
        a share mounted without read rights): not corruption, so nothing may be moved."""
        root = os.path.join(self.dir, str(step))
        for d, dirs, files in os.walk(root):
            for name in [d] + [os.path.join(d, f) for f in files]:
                if not os.access(name, os.R_OK | (os.X_OK if os.path.isdir(name) else 0)):
                    return name
        return None

    def restore_newest_good(self, like_state) -> tuple[dict, dict, int]:
        """(state, data position, step) of the newest checkpoint that restores. A checkpoint
        that fails to restore (a truncated or corrupted file) is reported and moved to
        :attr:`quarantine_dir`, and the one before it is tried, so training resumes instead of
        dying and the evidence stays. One that this process cannot read is an error naming the
        file: moving it would hide a permissions problem as corruption."""
        import shutil
        import sys
        import time
        for step in sorted(self.mngr.all_steps(), reverse=True):
            bad = self._unreadable(step)
            if bad:
                raise ValueError(f"checkpoint step {step} cannot be read ({bad}: permission "
                                 f"denied); give this user read access to {self.dir}, or "
                                 f"train into a new --out")
            try:
                state, data = self.restore(step, like_state)
                return state, data, step
            except Exception as e:  # noqa: BLE001 - any failure to read this step
                reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
                dest = os.path.join(self.quarantine_dir, f"{step}-{time.strftime('%Y%m%dT%H%M%S')}")
                try:
                    os.makedirs(self.quarantine_dir, exist_ok=True)
                    shutil.move(os.path.join(self.dir, str(step)), dest)
                except OSError as move_error:
                    raise ValueError(f"checkpoint step {step} in {self.dir} does not restore "
                                     f"({type(e).__name__}: {reason}) and cannot be moved aside "
                                     f"({move_error.strerror}); move it out of the way by hand "
                                     f"and run again") from None
                print(f"warning: checkpoint step {step} in {self.dir} does not restore "
                      f"({type(e).__name__}: {reason}); moved to {dest}, trying the one before",
                      file=sys.stderr)
                self.mngr.reload()
        raise ValueError(f"no checkpoint in {self.dir} restores (the failed ones are in "
                         f"{self.quarantine_dir}); start the run in a new --out")

    def wait(self) -> None:
        self.mngr.wait_until_finished()

    def close(self) -> None:
        self.mngr.close()
