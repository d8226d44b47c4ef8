"""ExecutorService over gRPC: proto <-> domain, then delegate.

Thin on purpose: packed bytes become numpy views (a malformed payload is
INVALID_ARGUMENT), the ``Executor`` validates and runs
the step on a worker thread (the event loop stays free for health checks),
and the result is packed back. Domain errors become status codes in
``kvpager.server``'s interceptor, never strings in a payload.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from executor_service.executor import Executor
from executor_service.step import CacheOps, Sampling, StepInput, StepOutput
from executor_service.tables import TableChanges
from kvpager.errors import FailedPrecondition, InvalidArgument, Unavailable
from kvpager.v1 import common_pb2, executor_pb2, executor_pb2_grpc


def _view(data: bytes, dtype: str, field: str) -> np.ndarray:
    """A read-only little-endian view of the payload (no copy), native order."""
    size = np.dtype(dtype).itemsize
    if len(data) % size:
        raise InvalidArgument(f"{field}: {len(data)} bytes is not a whole number of {size}-byte values")
    a = np.frombuffer(data, dtype=dtype)
    return a if a.dtype.isnative else a.astype(a.dtype.newbyteorder("="))


def _i32(data: bytes, field: str) -> np.ndarray:
    return _view(data, "<i4", field)


def _i64(data: bytes, field: str) -> np.ndarray:
    return _view(data, "<i8", field)


def _f32(data: bytes, field: str) -> np.ndarray:
    return _view(data, "<f4", field)


def _opt(data: bytes, decode, field: str) -> np.ndarray | None:
    """An absent (empty) optional column is None: the default applies."""
    return decode(data, field) if data else None


_NO_OPS = common_pb2.CacheOps()
_NO_TABLES = common_pb2.TableChanges()


def cache_ops_from_proto(ops: common_pb2.CacheOps) -> CacheOps:
    if ops == _NO_OPS:
        return CacheOps()
    return CacheOps(
        copy_src=_i32(ops.copy_src, "cache_ops.copy_src"),
        copy_dst=_i32(ops.copy_dst, "cache_ops.copy_dst"),
        swap_out_src=_i32(ops.swap_out_src, "cache_ops.swap_out_src"),
        swap_out_dst=_i32(ops.swap_out_dst, "cache_ops.swap_out_dst"),
        swap_in_src=_i32(ops.swap_in_src, "cache_ops.swap_in_src"),
        swap_in_dst=_i32(ops.swap_in_dst, "cache_ops.swap_in_dst"),
    )


def _offsets(data: bytes, field: str) -> np.ndarray:
    return _i32(data, field) if data else np.zeros(1, np.int32)


def tables_from_proto(t: common_pb2.TableChanges) -> TableChanges:
    if t == _NO_TABLES:  # a decode step inside its blocks: nothing changed
        return TableChanges()
    return TableChanges(
        forks=[(f.parent_seq_id, list(f.child_seq_ids)) for f in t.forks],
        dropped=_i64(t.dropped_seq_ids, "tables.dropped_seq_ids"),
        started_seq_ids=_i64(t.started_seq_ids, "tables.started_seq_ids"),
        started_context_lens=_i32(t.started_context_lens, "tables.started_context_lens"),
        started_offsets=_offsets(t.started_offsets, "tables.started_offsets"),
        started_block_ids=_i32(t.started_block_ids, "tables.started_block_ids"),
        extended_seq_ids=_i64(t.extended_seq_ids, "tables.extended_seq_ids"),
        extended_first_index=_i32(t.extended_first_index, "tables.extended_first_index"),
        extended_offsets=_offsets(t.extended_offsets, "tables.extended_offsets"),
        extended_block_ids=_i32(t.extended_block_ids, "tables.extended_block_ids"),
    )


def step_from_proto(req: executor_pb2.ExecuteRequest) -> StepInput:
    s = req.sampling
    plan = req.plan
    return StepInput(
        step_id=req.step_id,
        incarnation=req.incarnation,
        seq_ids=_i64(plan.seq_ids, "plan.seq_ids"),
        query_lens=_i32(plan.query_lens, "plan.query_lens"),
        token_ids=_i32(req.token_ids, "token_ids"),
        table_epoch=plan.table_epoch,
        tables=tables_from_proto(plan.tables),
        group_tables=[tables_from_proto(t) for t in plan.group_tables],
        context_lens=_opt(req.context_lens, _i32, "context_lens"),
        cache_ops=cache_ops_from_proto(plan.cache_ops),
        prev_step_id=req.prev_step_id,
        decode_steps=req.decode_steps,
        sampling=Sampling(
            num_samples=_opt(s.num_samples, _i32, "sampling.num_samples"),
            temperature=_opt(s.temperature, _f32, "sampling.temperature"),
            top_p=_opt(s.top_p, _f32, "sampling.top_p"),
            top_k=_opt(s.top_k, _i32, "sampling.top_k"),
            seeds=_opt(s.seeds, _i64, "sampling.seeds"),
            num_top_logprobs=_opt(s.num_top_logprobs, _i32, "sampling.num_top_logprobs"),
            return_logprobs=s.return_logprobs,
            presence_penalty=_opt(s.presence_penalty, _f32, "sampling.presence_penalty"),
            frequency_penalty=_opt(s.frequency_penalty, _f32, "sampling.frequency_penalty"),
            repetition_penalty=_opt(s.repetition_penalty, _f32, "sampling.repetition_penalty"),
            min_p=_opt(s.min_p, _f32, "sampling.min_p"),
            bias_offsets=_opt(s.logit_bias_offsets, _i32, "sampling.logit_bias_offsets"),
            bias_token_ids=_opt(s.logit_bias_token_ids, _i32, "sampling.logit_bias_token_ids"),
            bias_values=_opt(s.logit_bias_values, _f32, "sampling.logit_bias_values"),
            prompt_lens=_opt(s.prompt_lens, _i32, "sampling.prompt_lens"),
            history_offsets=_opt(s.history_offsets, _i32, "sampling.history_offsets"),
            history_token_ids=_opt(s.history_token_ids, _i32, "sampling.history_token_ids"),
        ),
    )


def _samples(out: StepOutput) -> dict[str, bytes]:
    """The sampled tokens and their logprobs (when asked), packed."""
    return dict(sampled_token_ids=out.sampled_token_ids.astype("<i4").tobytes(),
                sampled_logprobs=(out.sampled_logprobs.astype("<f4").tobytes()
                                  if out.sampled_logprobs is not None else b""))


def response_from_output(out: StepOutput) -> executor_pb2.ExecuteResponse:
    return executor_pb2.ExecuteResponse(
        step_id=out.step_id,
        **_samples(out),
        top_offsets=out.top_offsets.astype("<i4").tobytes(),
        top_token_ids=out.top_token_ids.astype("<i4").tobytes(),
        top_logprobs=out.top_logprobs.astype("<f4").tobytes(),
        forward_s=out.forward_s,
        sample_s=out.sample_s,
        cache_ops_s=out.cache_ops_s,
        sub_steps_run=out.sub_steps_run,
        sub_step_carried=out.sub_step_carried,
    )


def partial_response(sub_step: int, out: StepOutput) -> executor_pb2.ExecuteResponse:
    """One burst sub-step's samples (ExecuteStream): its rows' tokens, in row order."""
    return executor_pb2.ExecuteResponse(step_id=out.step_id, partial=True, sub_step=sub_step, **_samples(out))


# How long a step planned ahead waits for the step it follows to arrive.
PREVIOUS_STEP_WAIT_S = 30.0


class ExecutorServicer(executor_pb2_grpc.ExecutorServiceServicer):
    """Answers UNAVAILABLE until ``attach(executor)`` (the model is loading)."""

    # Called by the gateway every step: its request id comes back in trailing metadata (kvpager.server).
    PER_STEP_METHODS = ("Execute", "ExecuteStream")

    def __init__(self, executor: Executor | None = None) -> None:
        self.executor = executor
        # One worker: steps are serialised anyway, and torch releases the GIL.
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="executor-step")
        self._submitted = 0                  # the latest step id handed to the worker
        self._order = asyncio.Condition()    # notified when it changes

    def attach(self, executor: Executor) -> None:
        self.executor = executor

    def _ready(self) -> Executor:
        if self.executor is None:
            raise Unavailable("executor is loading its model", retry_after_s=1.0)
        return self.executor

    def close(self) -> None:
        self._worker.shutdown(wait=False, cancel_futures=True)

    async def Execute(self, request, context):
        return response_from_output(await (await self._hand_over(request)))

    async def ExecuteStream(self, request, context):
        """Execute, answering a decode burst's sub-steps as they end (all but the
        last: partial messages), then the whole response."""
        loop = asyncio.get_running_loop()
        parts: asyncio.Queue = asyncio.Queue()
        done = object()

        def on_part(j: int, out: StepOutput) -> None:  # on the step thread, in sub-step order
            loop.call_soon_threadsafe(parts.put_nowait, partial_response(j, out))

        # Handed over here, in the handler, as Execute does: steps reach the worker in the order they came.
        future = await self._hand_over(request, on_part)
        # The worker hands the partials over before the step's own result, so `done` comes last.
        future.add_done_callback(lambda _: parts.put_nowait(done))
        try:
            while (msg := await parts.get()) is not done:
                yield msg
            yield response_from_output(future.result())
        finally:
            if not future.done():  # the caller went away: the step still runs, its result is dropped
                future.add_done_callback(lambda f: f.cancelled() or f.exception())

    async def _hand_over(self, request, on_part=None) -> asyncio.Future:
        """The step, checked and queued on the worker (after the step it follows,
        ``prev_step_id``, was); its future."""
        try:
            executor = self._ready()
            step = step_from_proto(request)
        except Exception:
            await self._handed_over(request.step_id)  # a step waiting for this one fails fast, not by timeout
            raise
        if request.cut_prev and step.prev_step_id:
            executor.request_cut(step.prev_step_id)  # this step waits a layer or so, not the rest of the burst
        if step.prev_step_id and self._submitted < step.prev_step_id:
            # Planned while its previous step ran: queue behind that step, which
            # another call is bringing (the gateway sent it first).
            try:
                async with self._order:
                    await asyncio.wait_for(self._order.wait_for(lambda: self._submitted >= step.prev_step_id),
                                           PREVIOUS_STEP_WAIT_S)
            except TimeoutError:
                raise FailedPrecondition(f"step {step.step_id} waits for step {step.prev_step_id}, which did not "
                                         f"come within {PREVIOUS_STEP_WAIT_S:g} s") from None
        loop = asyncio.get_running_loop()
        # The worker runs steps in the order they are handed over: the next
        # step starts the moment this one ends, with no wake-up in between.
        future = loop.run_in_executor(self._worker, executor.execute, step, on_part)
        await self._handed_over(step.step_id)
        return future

    async def _handed_over(self, step_id: int) -> None:
        if step_id > self._submitted:
            self._submitted = step_id
            async with self._order:
                self._order.notify_all()

    async def GetInfo(self, request, context):
        info = self._ready().info()
        return executor_pb2.ExecutorInfo(
            executor_id=info.executor_id,
            model_id=info.model_id,
            model_type=info.model_type,
            vocab_size=info.vocab_size,
            max_model_len=info.max_model_len,
            eos_token_ids=info.eos_token_ids,
            num_layers=info.num_layers,
            num_kv_heads=info.num_kv_heads,
            head_dim=info.head_dim,
            dtype=info.dtype,
            device=info.device,
            attention_backend=info.attention_backend,
            model_impl=info.model_impl,
            num_blocks=info.num_blocks,
            block_size=info.block_size,
            num_swap_blocks=info.num_swap_blocks,
            incarnation=info.incarnation,
            pool_generation=info.pool_generation,
            kv_pool_bytes=info.kv_pool_bytes,
            kv_layout=info.kv_layout,
            kv_groups=[executor_pb2.KvGroupInfo(window=w, layers=list(layers)) for w, layers in info.kv_groups],
        )

    async def ConfirmPool(self, request, context):
        executor = self._ready()
        confirmed, last, written = executor.confirm_with_writes(request.incarnation, request.pool_generation,
                                                                request.written_since_step)
        return executor_pb2.ConfirmPoolResponse(
            confirmed=confirmed,
            incarnation=executor.incarnation,
            pool_generation=executor.pool_generation,
            last_step_id=last,
            writes_known=written is not None,
            written_block_ids=written.tobytes() if written is not None else b"",
        )
