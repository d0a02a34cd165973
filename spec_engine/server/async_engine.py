"""The backend API: an asyncio front to ``Engine`` that any server can embed.

    engine = AsyncEngine(llm)
    stream = await engine.add_request("def fib(n):", SamplingParams(max_tokens=32))  # ValueError if invalid
    async for delta in stream:                                                       # Delta per engine step
        print(delta.text, end="")
    engine.abort(stream.request_id)                                                  # or: await stream.aclose()

One background thread owns the ``Engine``: it runs ``engine.step()`` while any request is unfinished and sleeps on
a condition when idle. Torch compute blocks, so it cannot run on the asyncio loop; and one loop for every request
is what makes concurrent requests share target passes (continuous batching). Other threads never touch the engine:
``add_request``/``abort`` queue commands that the loop thread runs between steps, so every mutation (add, abort,
step) happens in that thread under one lock. Results go back to per-request ``asyncio.Queue``s through
``loop.call_soon_threadsafe``.

Glossary: a *delta* is what one engine step added to one request: its new token ids and the new text.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from spec_engine.inputs import RequestError
from spec_engine.request import Request, StepOutput
from spec_engine.sampling import (
    REPLACEMENT_CHAR,
    SamplingParams,
    output_text,
    stop_search_start,
    truncate_prompt,
    visible_text,
)

log = logging.getLogger("spec_engine.server")


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass
class Delta:
    """What one engine step added to one request. Concatenating every delta's ``text`` gives the decoded output.

    ``finish_reason`` is "stop" | "length" | "abort" | "error" on the last delta (``finished``), else None; "error"
    means the engine failed this request alone (its row raised; the others in the step went on), and ``error`` says
    why. ``usage`` counts the tokens so far. ``metrics`` (the request's speculation figures,
    ``RequestMetrics.as_dict``) is set on the last delta only. ``logprobs``: where the request asks
    (``SamplingParams.logprobs``), those of ``token_ids`` (``Request.output_logprobs``'s entries), else None;
    ``prompt_logprobs`` the prompt's (``SamplingParams.prompt_logprobs``), on the first delta only.
    """

    request_id: str
    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: str | None = None
    usage: Usage | None = None
    metrics: dict | None = None
    error: str | None = None
    logprobs: list[dict[int, float]] | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None


class EngineDeadError(RuntimeError):
    """The engine loop failed; the request cannot complete."""


class RequestStream:
    """The async iterator of one request's deltas. Closing it early (``aclose``, or leaving ``async with``, or
    cancelling the task that iterates it) aborts the request, which frees its KV blocks at once."""

    def __init__(self, engine: AsyncEngine, request_id: str, num_prompt_tokens: int, queue: asyncio.Queue):
        self.request_id = request_id
        self.num_prompt_tokens = num_prompt_tokens
        self._engine, self._queue, self._done = engine, queue, False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> Delta:
        if self._done:
            raise StopAsyncIteration
        try:
            item = await self._queue.get()
        except BaseException:  # cancelled: the consumer is gone
            await self.aclose()
            raise
        if isinstance(item, BaseException):
            self._done = True
            raise item
        self._done = item.finished
        return item

    async def aclose(self) -> None:
        if not self._done:
            self._done = True
            self._engine.abort(self.request_id)

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    def __del__(self):
        if not self._done:  # dropped without closing: do not decode for nobody
            self._engine.abort(self.request_id)


@dataclass
class _Sink:
    """Where one request's deltas go, and how much of its text was already sent."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    num_prompt_tokens: int
    sent_text: str = ""
    delivered: bool = False  # a delta went out (the first carries the prompt's logprobs)
    prompt: list[int] = field(default_factory=list)  # the request's: its output's text reads after it (``output_text``)
    # the output's text decoded so far (``AsyncEngine._new_text``): ``text`` of its tokens before ``read_offset``,
    # the last window decoded again from ``prefix_offset`` (a character's bytes may span tokens; a window from the
    # output's start, after the prompt)
    text: str = ""
    prefix_offset: int = 0
    read_offset: int = 0
    search_start: int | None = None  # where a stop string may end (``stop_search_start``), once min_tokens are out

    def put(self, item) -> bool:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
            return True
        except RuntimeError:  # the consumer's event loop is closed
            return False


@dataclass
class _Totals:
    num_requests: int = 0
    num_prompt_tokens: int = 0
    finished: dict = field(default_factory=lambda: {"stop": 0, "length": 0, "abort": 0, "error": 0})


class AsyncEngine:
    """Serve ``llm.engine`` to asyncio code: concurrent ``add_request`` streams, ``abort``, ``stats``.

    Parameters
    ----------
    llm : a ``spec_engine.LLM``; its engine, tokenizer and KV allocator are used. The engine belongs to the loop
        thread: ``llm.generate`` raises ``RuntimeError`` until ``close``.
    """

    def __init__(self, llm):
        if getattr(llm, "served_by", None) is not None:
            raise RuntimeError("this LLM is already served by an AsyncEngine: close that one first")
        self.llm = llm
        self.engine = llm.engine
        llm.served_by = self  # (LLM.generate refuses while it is: two threads would step one engine)
        self._cond = threading.Condition()
        self._commands: list[Callable[[], None]] = []
        self._sinks: dict[str, _Sink] = {}  # loop thread only
        self._totals = _Totals()  # loop thread only
        self._closed = False
        self._num_in_flight = 0  # added and not yet finished; guarded by _cond
        self.lock = threading.Lock()  # held by the loop thread around every engine mutation and step
        self._stats = self._snapshot()
        self._thread = threading.Thread(target=self._run, name="specdec-engine", daemon=True)
        self._thread.start()

    # --- the API -----------------------------------------------------------------------------------------------

    async def add_request(
        self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None
    ) -> RequestStream:
        """Queue a request; returns the async iterator of its deltas once the engine has accepted it.

        Raises ``ValueError`` (bad prompt or params, prompt + max_tokens past the context, a duplicate request id)
        before anything streams, and ``EngineDeadError`` after ``close``.
        """
        if self._closed:
            raise EngineDeadError("the engine was shut down")
        ids = await self.llm.inputs.prompt_async(prompt)
        ids = truncate_prompt(ids, params.truncate_prompt_tokens)  # (the prompt its usage counts)
        params = self.llm.inputs.word_ids(params)  # bad_words, guided_choice: strings to token ids
        request_id = request_id or uuid.uuid4().hex
        loop = asyncio.get_running_loop()
        accepted = loop.create_future()
        sink = _Sink(loop, asyncio.Queue(), len(ids), prompt=ids)
        with self._cond:
            self._num_in_flight += 1
        grammars = self.engine.grammars
        if params.guided and grammars is not None:  # compiled here, off the engine's thread: add() finds it cached
            try:
                await asyncio.to_thread(grammars.check, params)
            except BaseException as e:
                self._release()
                if isinstance(e, ValueError):
                    raise RequestError(str(e), params.guided[0]) from None
                raise

        def add() -> None:
            try:
                if request_id in self._sinks:
                    raise ValueError(f"request id {request_id!r} is already in flight")
                self.engine.add_request(ids, params, request_id)
            except Exception as e:  # ValueError for bad input; anything else is handed over too, never swallowed
                self._release()
                loop.call_soon_threadsafe(_resolve, accepted, e)
                return
            self._sinks[request_id] = sink
            self._totals.num_requests += 1
            self._totals.num_prompt_tokens += len(ids)
            loop.call_soon_threadsafe(_resolve, accepted, None)

        self._submit(add)
        try:
            error = await accepted
        except BaseException:  # cancelled while queued: the client left before the engine saw the request
            self.abort(request_id)
            raise
        if error is not None:
            raise error
        return RequestStream(self, request_id, len(ids), sink.queue)

    def abort(self, request_id: str) -> None:
        """Stop a request and free its KV blocks before the next step. Thread-safe; unknown ids are ignored."""

        def abort() -> None:
            req = next((r for r in (*self.engine.waiting, *self.engine.running) if r.request_id == request_id), None)
            self.engine.abort(request_id)
            sink = self._sinks.pop(request_id, None)
            if sink is not None:
                self._release()
            if sink is not None and req is not None:
                self._totals.finished["abort"] += 1
                text = self._new_text(sink, req.text_token_ids, finished=True, params=req.params)
                usage = Usage(sink.num_prompt_tokens, len(req.output_token_ids), req.metrics.num_cached_tokens)
                metrics = req.metrics.as_dict(usage.completion_tokens)
                sink.put(Delta(request_id, [], text, True, "abort", usage, metrics))

        self._submit(abort)

    @property
    def num_in_flight(self) -> int:
        """Requests added and not yet finished, waiting and running (what a server bounds with 429s)."""
        return self._num_in_flight

    def stats(self) -> dict:
        """Engine-wide figures, as of the last step (never blocks on the engine)."""
        return dict(self._stats)

    @property
    def alive(self) -> bool:
        """The loop thread runs and the LLM can still step (False once a tensor-parallel worker died)."""
        return self._thread.is_alive() and self.llm.healthy

    def close(self, timeout: float | None = 10.0) -> None:
        """Stop the loop thread; in-flight requests end with ``EngineDeadError``."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout)
        if not self._thread.is_alive() and self.llm.served_by is self:
            self.llm.served_by = None

    # --- the loop thread ---------------------------------------------------------------------------------------

    def _submit(self, command: Callable[[], None]) -> None:
        with self._cond:
            self._commands.append(command)
            self._cond.notify()

    def _release(self) -> None:
        with self._cond:
            self._num_in_flight -= 1

    def _run(self) -> None:
        busy = False
        while True:
            with self._cond:  # guards only the command list, so add/abort never wait for a step
                while not (self._commands or busy or self._closed):
                    self._cond.wait()
                if self._closed:
                    break
                commands, self._commands = self._commands, []
            with self.lock:
                try:
                    for command in commands:
                        command()
                    outputs = self.engine.step() if self.engine.has_unfinished() else []
                except Exception as e:
                    log.exception("engine step failed; failing %d requests", len(self._sinks))
                    self._fail_all(EngineDeadError(f"the engine step failed: {e!r}"))
                    outputs = []
                for out in outputs:
                    sink = self._sinks.get(out.request.request_id)
                    try:
                        self._deliver(out)
                    except Exception as e:  # (a bug turning this output into a delta: its request fails alone)
                        log.exception("delivering request %s's output failed", out.request.request_id)
                        self._fail_request(out.request, sink, e)
                busy = self.engine.has_unfinished()
                try:
                    self._stats = self._snapshot()
                except Exception:  # (/health keeps the last figures; the loop goes on)
                    log.exception("the engine's figures failed")
        with self.lock:  # commands queued before close: adds are accepted, then failed with everything else
            with self._cond:
                commands, self._commands = self._commands, []
            for command in commands:
                command()
            self._fail_all(EngineDeadError("the engine was shut down"))

    def _deliver(self, out: StepOutput) -> None:
        req: Request = out.request
        sink = self._sinks.get(req.request_id)
        if sink is None:
            return
        text = self._new_text(sink, req.text_token_ids, finished=out.finished, params=req.params)
        usage = Usage(sink.num_prompt_tokens, len(req.output_token_ids), req.metrics.num_cached_tokens)
        delta = Delta(req.request_id, list(out.new_token_ids), text, out.finished, req.finish_reason, usage)
        if req.params.logprobs is not None:
            delta.logprobs = req.output_logprobs[len(req.output_logprobs) - len(out.new_token_ids) :]
        if req.params.prompt_logprobs is not None and not sink.delivered:
            delta.prompt_logprobs = list(req.prompt_logprobs)
        sink.delivered = True
        if out.finished:
            delta.metrics = req.metrics.as_dict(len(req.output_token_ids))
            delta.error = req.error if req.finish_reason == "error" else None
            self._totals.finished[req.finish_reason] = self._totals.finished.get(req.finish_reason, 0) + 1
            del self._sinks[req.request_id]
            self._release()
        if not sink.put(delta) and not out.finished:
            self.engine.abort(req.request_id)
            del self._sinks[req.request_id]
            self._release()

    def _new_text(self, sink: _Sink, output_ids: list[int], finished: bool,
                  params: SamplingParams | None = None) -> str:  # fmt: skip
        """The output's text not sent yet. The text is decoded incrementally (each step decodes its new tokens with
        the window before them, not the whole output: an output of n tokens costs n, not n^2, on the engine's
        thread); a trailing U+FFFD may be half a character whose other bytes are still to come, so it is held back
        (its tokens decoded again next step) until a later token (or the end) settles it; so is a tail that may
        begin a stop string, and a stop string itself is not sent unless the request includes it
        (``visible_text``)."""
        if self.llm.tokenizer is None:
            return ""
        skip = params.skip_special_tokens if params is not None else True
        text, decode = sink.text, self.llm.decode
        if sink.read_offset < len(output_ids):
            head = sink.prompt if sink.prefix_offset == 0 else []
            before = output_text(decode, head, output_ids[sink.prefix_offset : sink.read_offset], skip)
            window = output_text(decode, head, output_ids[sink.prefix_offset :], skip)
            # ByteFallback reads a run of byte tokens that is not UTF-8 as U+FFFD throughout, so later bytes can turn
            # a character it showed into U+FFFD: the window no longer begins with its settled text. While the run
            # may still end as UTF-8 (the window ends in U+FFFD) its text is held back; once it cannot, what was
            # settled stays sent (the stream stalled here before) and the tokens past it are read alone (they begin
            # with a byte: no space to lose)
            rewritten = not window.startswith(before)
            held = rewritten and not finished and window.endswith(REPLACEMENT_CHAR)
            if rewritten and not held:
                sink.prefix_offset = sink.read_offset
                before, window = "", decode(output_ids[sink.read_offset :], skip)
            pending = window[len(before) :]  # the text of the tokens past read_offset
            if finished or pending and not pending.endswith(REPLACEMENT_CHAR):  # settled: the window moves on
                sink.text += pending
                sink.prefix_offset, sink.read_offset = sink.read_offset, len(output_ids)
                text = sink.text
            elif held:
                text = sink.text
            else:  # shown but for a cut character at its end, decoded again with the next tokens
                text = sink.text + pending.rstrip(REPLACEMENT_CHAR)
        if params is not None and params.stop:
            start = sink.search_start
            if start is None:  # (past min_tokens' share of the text: fixed once that many tokens are out)
                start = stop_search_start(params, output_ids, decode, sink.prompt)
                if len(output_ids) >= params.min_tokens - 1:
                    sink.search_start = start
            text = visible_text(text, params.stop, finished, params.include_stop_str_in_output, start)
        if not text.startswith(sink.sent_text):  # a decoder that rewrites earlier text (a byte-level one never does)
            return ""
        new = text[len(sink.sent_text) :]
        sink.sent_text = text if new else sink.sent_text
        return new

    def _fail_request(self, req: Request, sink: _Sink | None, error: Exception) -> None:
        """End ``req`` alone with finish reason "error" (its delta could not be made), freeing its blocks."""
        if not req.finished:
            self.engine.abort(req.request_id)
        if self._sinks.pop(req.request_id, None) is not None:
            self._release()
            self._totals.finished["error"] = self._totals.finished.get("error", 0) + 1
        if sink is not None:
            usage = Usage(sink.num_prompt_tokens, len(req.output_token_ids), req.metrics.num_cached_tokens)
            sink.put(Delta(req.request_id, [], "", True, "error", usage, error=f"internal error: {error!r}"))

    def _fail_all(self, error: BaseException) -> None:
        """End every in-flight request with ``error`` and free its blocks; the engine then serves new requests."""
        for rid, sink in list(self._sinks.items()):
            self.engine.abort(rid)
            self._totals.finished["error"] += 1
            self._release()
            sink.put(error)
        self._sinks.clear()

    def _snapshot(self) -> dict:
        alloc, totals = self.llm.allocator, self._totals
        m = self.engine.metrics()  # the engine's own snapshot: nothing here reads its attributes
        return {
            "num_requests_running": m["num_requests_running"],
            "num_requests_waiting": m["num_requests_waiting"],
            "num_requests_total": totals.num_requests,
            "num_requests_finished": dict(totals.finished),
            "num_prompt_tokens": totals.num_prompt_tokens,
            "num_cached_prompt_tokens": m["num_cached_tokens"],  # prompt tokens the prefix cache spared
            "num_generated_tokens": m["num_generated"],
            "num_preemptions": m["num_preemptions"],  # requests whose blocks went to older ones (resumed later)
            "num_steps": m["num_steps"],  # per-request target passes while decoding
            "num_drafted_tokens": m["num_drafted"],
            "num_accepted_tokens": m["num_accepted"],
            "acceptance_rate": m["num_accepted"] / m["num_drafted"] if m["num_drafted"] else 0.0,
            "mean_accepted_length": (m["num_accepted"] + m["num_steps"]) / m["num_steps"] if m["num_steps"] else 0.0,
            "accepted_length_hist": m["accepted_hist"],  # [k] = target passes that accepted k drafted tokens
            "num_speculative_tokens": m["num_speculative_tokens"],  # fixed depth, or the adaptive controller's deepest
            "adaptive": m["adaptive"],
            "depth_hist": m["gamma_hist"],  # [g] = row-steps drafted at depth g (0 = not drafted)
            "last_step_depth": m["last_step_depth"],
            "kv_blocks_used": alloc.num_used,
            "kv_blocks_total": alloc.num_blocks - 1,  # block 0 is scratch
        }


def _resolve(future: asyncio.Future, error: BaseException | None) -> None:
    if not future.done():
        future.set_result(error)
