"""An in-process fake prefill/decode node for router tests: real ZMQ and real wire messages, no model.

It registers, heartbeats, and "generates" deterministic tokens: a script of token ids when given
(then EOS), else token = (last * 7 + 3) % vocab_size. It honours max_tokens, EOS (unless
ignore_eos), stop_token_ids and logprobs, and sets finish_reason on the last token, as a real node
does. A prefill node sends FirstToken; when the router names a decode node, the prefill fake hands
the rest of the output to that fake directly (the `cluster` dict stands in for the KV transfer),
and the decode fake streams it as TokenBatch messages. Abort messages are recorded and stop the
request's generation.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os

import zmq
import zmq.asyncio

from pdserve.engine.sampling_params import SamplingParams
from pdserve.protocol.messages import (
    Abort,
    Deregister,
    Error,
    FirstToken,
    Heartbeat,
    Message,
    PrefillRequest,
    Register,
    Reregister,
    SetRole,
    Token,
    TokenBatch,
    decode,
)

EOS_TOKEN_ID = 257  # the tiny tokenizer's </s>


def next_token(last: int, vocab_size: int) -> int:
    return (last * 7 + 3) % vocab_size


class FakeNode:
    def __init__(self, node_id: str, role: str = "both", *, cluster: dict[str, FakeNode] | None = None,
                 vocab_size: int = 256, max_model_len: int = 256, num_total_blocks: int = 1000,
                 script: list[int] | None = None, token_delay_s: float = 0.0, first_token_delay_s: float = 0.0,
                 reverse_order: bool = False, fail: str | None = None, retryable: bool = False,
                 heartbeat_interval_s: float = 0.05, ready: bool = True, max_num_seqs: int = 0) -> None:
        self.node_id, self.role = node_id, role
        self.cluster = cluster if cluster is not None else {}
        self.cluster[node_id] = self
        self.vocab_size, self.max_model_len, self.num_total_blocks = vocab_size, max_model_len, num_total_blocks
        self.script = script
        self.token_delay_s = token_delay_s  # between decode tokens
        self.first_token_delay_s = first_token_delay_s  # before FirstToken (after the hand-off to decode)
        self.reverse_order = reverse_order  # decode: send all tokens at once, last index first
        self.fail, self.retryable = fail, retryable  # send Error instead of tokens
        self.heartbeat_interval_s = heartbeat_interval_s
        self.ready = ready
        self.heartbeating = True
        self.max_num_seqs = max_num_seqs
        self.pid = os.getpid()  # change it to look like a restarted process
        self.reregisters = 0
        self.swallow = 0  # PrefillRequests to drop without a trace (a message lost with a dying node)
        self.prefills: list[PrefillRequest] = []
        self.set_roles: list[SetRole] = []
        self.aborts: list[Abort] = []
        self.tasks: dict[str, asyncio.Task] = {}  # request_id -> its generation
        self._ctx = zmq.asyncio.Context()
        self._sock: zmq.asyncio.Socket | None = None
        self._loops: list[asyncio.Task] = []

    # ---- lifecycle ------------------------------------------------------------------------------
    async def start(self, control_addr: str) -> None:
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.IDENTITY, self.node_id.encode())
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(control_addr)
        await self.register()
        self._loops = [asyncio.create_task(self._recv_loop()), asyncio.create_task(self._heartbeat_loop())]

    async def close(self) -> None:
        for task in [*self._loops, *self.tasks.values()]:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._sock is not None:
            self._sock.close(linger=0)
        self._ctx.term()

    async def register(self) -> None:
        await self.send(Register(self.node_id, self.role, "tiny", kv_addr=f"inproc://{self.node_id}-kv",
                                 num_total_blocks=self.num_total_blocks, block_size=16,
                                 max_model_len=self.max_model_len, pid=self.pid, max_num_seqs=self.max_num_seqs))

    async def send(self, msg: Message) -> None:
        await self._sock.send(msg.encode())

    async def send_raw(self, *frames: bytes) -> None:
        await self._sock.send_multipart(list(frames))

    async def deregister(self) -> None:
        await self.send(Deregister(self.node_id))

    @property
    def aborted_ids(self) -> set[str]:
        return {a.request_id for a in self.aborts}

    # ---- loops -------------------------------------------------------------------------------
    async def _heartbeat_loop(self) -> None:
        while True:
            if self.heartbeating:
                await self.send(Heartbeat(self.node_id, self.num_total_blocks - 10 * len(self.tasks),
                                          self.num_total_blocks, len(self.tasks), 0, ready=self.ready,
                                          request_ids=list(self.tasks)))
            await asyncio.sleep(self.heartbeat_interval_s)

    async def _recv_loop(self) -> None:
        while True:
            msg = decode(await self._sock.recv())
            if isinstance(msg, PrefillRequest):
                self.prefills.append(msg)
                if self.swallow:
                    self.swallow -= 1
                    continue
                self._run(msg.request_id, self._prefill(msg))
            elif isinstance(msg, Reregister):
                self.reregisters += 1
                await self.register()
            elif isinstance(msg, SetRole):  # drain, then register again with the new role
                self.set_roles.append(msg)
                self._loops.append(asyncio.create_task(self._change_role(msg.role)))
            elif isinstance(msg, Abort):
                self.aborts.append(msg)
                for rid in [r for r in self.tasks if r == msg.request_id or r.startswith(msg.request_id + "#")]:
                    self.tasks.pop(rid).cancel()  # an n > 1 request's id: its choices too

    async def _change_role(self, role: str) -> None:
        self.ready = False
        while self.tasks:
            await asyncio.sleep(0.01)
        self.role = role
        await self.register()
        self.ready = True

    def _run(self, request_id: str, coro) -> None:
        task = asyncio.create_task(coro)
        self.tasks[request_id] = task
        task.add_done_callback(lambda t: self.tasks.pop(request_id, None) if self.tasks.get(request_id) is t else None)

    # ---- generation --------------------------------------------------------------------------
    def generate(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams) -> list[Token]:
        out, last = [], prompt_token_ids[-1]
        for i in range(sampling.max_tokens):
            if self.script is not None:
                token_id = self.script[i] if i < len(self.script) else EOS_TOKEN_ID
            else:
                token_id = next_token(last, self.vocab_size)
            last = token_id
            finish = None
            if (token_id == EOS_TOKEN_ID and not sampling.ignore_eos) or token_id in sampling.stop_token_ids:
                finish = "stop"
            elif i == sampling.max_tokens - 1:
                finish = "length"
            out.append(Token(request_id, i, token_id, self._logprobs(token_id, sampling), finish))
            if finish:
                break
        return out

    def _logprobs(self, token_id: int, sampling: SamplingParams) -> dict | None:
        if sampling.logprobs is None:
            return None
        top = {(token_id + k) % self.vocab_size: -1.0 - k for k in range(1, sampling.logprobs + 1)}
        return {**top, token_id: -0.5}

    async def _prefill(self, req: PrefillRequest) -> None:
        if self.fail:
            await self.send(Error(req.request_id, self.node_id, self.fail, retryable=self.retryable))
            return
        sampling = SamplingParams.from_dict(req.sampling)
        if sampling.n > 1:  # one prefill, then choices `{id}#{i}` (the last prompt token + i seeds choice i)
            await asyncio.sleep(self.first_token_delay_s)
            for i in range(sampling.n):
                prompt = req.prompt_token_ids[:-1] + [req.prompt_token_ids[-1] + i]
                choice = dataclasses.replace(req, request_id=f"{req.request_id}#{i}", prompt_token_ids=prompt,
                                             sampling=sampling.for_choice(i).to_dict())
                self._run(choice.request_id, self._prefill(choice))
            return
        tokens = self.generate(req.request_id, req.prompt_token_ids, sampling)
        first, rest = tokens[0], tokens[1:]
        if rest and req.decode_node_id:
            decoder = self.cluster[req.decode_node_id]
            decoder._run(req.request_id, decoder._decode(req.request_id, rest))
        await asyncio.sleep(self.first_token_delay_s)
        await self.send(FirstToken(req.request_id, first.token_id, first.logprobs, first.finish_reason,
                                   num_prompt_tokens=len(req.prompt_token_ids)))
        if rest and not req.decode_node_id:
            await self._decode(req.request_id, rest)

    async def _decode(self, request_id: str, tokens: list[Token]) -> None:
        if self.fail:
            await asyncio.sleep(self.token_delay_s)
            await self.send(Error(request_id, self.node_id, self.fail, retryable=self.retryable))
            return
        if self.reverse_order:
            for token in reversed(tokens):
                await self.send(TokenBatch.from_tokens(self.node_id, [token]))
            return
        for token in tokens:
            await asyncio.sleep(self.token_delay_s)
            await self.send(TokenBatch.from_tokens(self.node_id, [token]))
