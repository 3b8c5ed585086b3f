"""STAND-IN for the scheduler's weight-update sessions (class
SchedulerWeightUpdaterManager of sgl-project/sglang after PR #28001, as
stored in the public index, which gave neither the file's commit nor a path
we could pin; this module's name is the stand-in's). Same rules, same order:

* begin_weight_update(req): asserts that no session is open ("begin_weight_
  update called while a weight-update session is already open"), calls
  begin_weight_update() on the selected ModelRunners (restores packed,
  e.g. quantized, weights to a loadable state), opens the session, marks it
  not loaded; returns (True, "Success").
* update_weights_from_tensor(req): asserts that a session is open
  ("update_weights_from_tensor requires an open begin_weight_update
  session"), deserializes this rank's payload, runs the runners'
  update_weights_from_tensor(named_tensors, load_format); on success marks
  the session loaded and flushes the cache when req.flush_cache.
* end_weight_update(req): asserts a session is open ("end_weight_update
  called without begin_weight_update"), calls end_weight_update(
  run_post_load=not loaded) on the runners the session selected, closes it.

sessions=False models the scheduler before sessions (sgl-project/sglang
scheduler_update_weights_mixin.py @ 018c9109680f6f5b0654114b9159101256e1e18b):
no assert, no session calls. Left out: draft runners, barriers, metrics.
Not SGLang's code."""
from sglang.srt.utils import MultiprocessingSerializer


class SchedulerWeightUpdaterManager:
    def __init__(self, runner, tp_rank: int, sessions: bool = True):
        self.runner, self.tp_rank, self.sessions = runner, tp_rank, sessions
        self._weight_update_in_progress = False
        self._weight_update_loaded = False
        self.flushes = 0

    def begin_weight_update(self, recv_req):
        assert not self._weight_update_in_progress, \
            "begin_weight_update called while a weight-update session is already open"
        self.runner.begin_weight_update()
        self._weight_update_in_progress = True
        self._weight_update_loaded = False
        return True, "Success"

    def end_weight_update(self, recv_req):
        assert self._weight_update_in_progress, "end_weight_update called without begin_weight_update"
        self.runner.end_weight_update(run_post_load=not self._weight_update_loaded)
        self._weight_update_in_progress = False
        return True, "Success"

    def update_weights_from_tensor(self, recv_req):
        if self.sessions:
            assert self._weight_update_in_progress, \
                "update_weights_from_tensor requires an open begin_weight_update session"
        named = MultiprocessingSerializer.deserialize(recv_req.serialized_named_tensors[self.tp_rank])
        success, message = self.runner.update_weights_from_tensor(named_tensors=named,
                                                                  load_format=recv_req.load_format)
        if success:
            self._weight_update_loaded = True
            if recv_req.flush_cache:
                self.flushes += 1
        return success, message
