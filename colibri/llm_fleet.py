"""The offline API on a local fleet (`LLM(model, workers=N)`): `colibri serve` as a child process that dies with
this one, its router reached through the Python client on loopback. A `generate` call sends as many requests at
once as the router's queue takes (the rest as those finish, as the in-process engine runs them) and aborts the
others when one fails."""

from __future__ import annotations

import collections
import dataclasses
import logging
import subprocess
import sys
import threading
import time
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait

import torch

from colibri.client import Client, GenerationError, check_utf8
from colibri.fleet import colibri_command
from colibri.fork import die_with_parent
from colibri.llm_types import CompletionOutput, Prompt, RequestOutput, SamplingParams, check_stop_ids, token_ids
from colibri.serve_options import ServeOptions
from colibri_common.config import ModelConfig
from colibri_common.flags import to_argv
from colibri_common.tokenizer import Tokenizer

log = logging.getLogger("colibri")
LOG_TAIL = 20                                     # the fleet's last log lines kept, for the error of a failed start


class LocalFleet:
    def __init__(self, model: str, serve: ServeOptions) -> None:
        """Start `colibri serve` with `serve` and wait for its `ready` line; raises RuntimeError if it exits
        first (its log, on this process's stderr, says why)."""
        self.model = model
        self.closed = False
        self.client: Client | None = None
        argv = [*colibri_command(), "serve", *to_argv(serve, ServeOptions.EXCLUDED)]
        log.info("starting a local fleet: colibri serve --workers %d", serve.workers)
        self.process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                        text=True, errors="replace", preexec_fn=die_with_parent)
        self._log_tail: collections.deque[str] = collections.deque(maxlen=LOG_TAIL)
        self._relay = threading.Thread(target=self._relay_log, name="fleet-stderr", daemon=True)
        self._relay.start()
        try:
            assert self.process.stdout is not None
            for line in self.process.stdout:
                if line.startswith("ready "):
                    addr = line.split()[1]
                    break
            else:
                code = self.process.wait()
                self._relay.join(timeout=5)              # its last lines read
                last = next((ln for ln in reversed(self._log_tail) if ln.strip()), "")
                raise RuntimeError(f"colibri serve exited with code {code} before it was ready"
                                   + (f": {last.strip()}" if last else " (it wrote no log)"))
            threading.Thread(target=self.process.stdout.read, name="fleet-stdout", daemon=True).start()
            self.client = Client(addr)
            self.tokenizer = Tokenizer.from_dir(model)
            self.vocab = ModelConfig.from_dir(model).vocab_size      # what the fleet's router checks ids against
            self.max_waiting = self.client.model_info().max_waiting  # what its queue takes at once
        except BaseException:
            self.close()
            raise

    def _relay_log(self) -> None:
        """The fleet's log onto this process's stderr, as it comes, its last lines kept for a failed start. It reads
        to the end whatever happens to the writes: serve and its children share the pipe, and a pipe nobody reads
        would block every one of them at their next log line."""
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self._log_tail.append(line)
            try:
                (sys.stderr or sys.__stderr__).write(line)      # type: ignore[union-attr]
            except (OSError, ValueError, AttributeError):      # closed, replaced by None (pythonw), detached
                pass

    def generate(self, prompts: list[Prompt], params: list[SamplingParams], rids: list[str]) -> list[RequestOutput]:
        if self.closed or self.client is None:
            raise RuntimeError("this LLM is closed")
        vocab = self.vocab
        for prompt, sp in zip(prompts, params, strict=True):         # every prompt checked before any runs
            if isinstance(prompt, str):
                check_utf8(prompt)
            else:
                bad = [t for t in token_ids(prompt) if not 0 <= t < vocab]
                if bad:
                    raise ValueError(f"token ids {bad[:8]} are outside the vocabulary [0, {vocab})")
            check_stop_ids(sp, vocab)
        stop = threading.Event()                       # set once one fails: the requests not yet sent are not sent

        def one(job: tuple[Prompt, SamplingParams, str]) -> RequestOutput | None:
            prompt, sp, rid = job
            if stop.is_set():
                return None
            fields = {f.name: getattr(sp, f.name) for f in dataclasses.fields(sp)}
            wire_prompt = prompt if isinstance(prompt, str) else token_ids(prompt)
            try:
                r = self._generate(wire_prompt, rid, fields, stop)
            except (GenerationError, ValueError) as exc:
                if self.closed:                        # closed under a running generate (another thread)
                    raise RuntimeError("this LLM is closed") from exc
                if isinstance(exc, ValueError):
                    raise
                raise (ValueError if exc.code().name == "INVALID_ARGUMENT" else RuntimeError)(exc.details()) from exc
            outs = [CompletionOutput(c.index, c.text, list(c.token_ids), c.finish_reason, c.stop_reason,
                                     [torch.from_numpy(x.copy()) for x in c.logits],
                                     [lp.logprob for lp in c.logprobs],
                                     [[(t.token_id, t.logprob) for t in lp.top] for lp in c.logprobs]
                                     if sp.top_logprobs else []) for c in r.choices]
            if isinstance(prompt, str):                # the router's tokenizer, the same file, with its BOS
                ids = self.tokenizer.encode(prompt, True) if self.tokenizer is not None else []
                return RequestOutput(rid, prompt, ids, outs)
            return RequestOutput(rid, None, list(wire_prompt), outs)

        # as many requests at once as the router's queue takes (each of n choices is a sequence there), the rest
        # as those finish: as the in-process engine runs a call
        at_once = max(1, min(64, len(prompts), self.max_waiting // max(sp.n for sp in params)))
        pool = ThreadPoolExecutor(max_workers=at_once)
        futures = [pool.submit(one, job) for job in zip(prompts, params, rids, strict=True)]
        try:
            wait(futures, return_when=FIRST_EXCEPTION)
            failed = next((f for f in futures if f.done() and f.exception() is not None), None)
            if failed is None:
                return [f.result() for f in futures]   # type: ignore[misc]  (none skipped: none failed)
            raise failed.exception()                   # type: ignore[misc]
        except BaseException:                          # a failure, or Ctrl-C: the others end now, not in full
            stop.set()
            self._abort_running(futures, rids)
            raise
        finally:
            pool.shutdown(wait=False, cancel_futures=True)

    def _generate(self, prompt: Prompt, rid: str, fields: dict, stop: threading.Event):
        """One request; a full queue (other clients' requests too) is waited out, 50 ms to 1 s between tries."""
        assert self.client is not None
        pause = 0.05
        while True:
            try:
                return self.client.generate(prompt, timeout=None, request_id=rid, **fields)
            except GenerationError as exc:
                if exc.code().name != "RESOURCE_EXHAUSTED" or "queue is full" not in exc.details() or stop.is_set():
                    raise
                time.sleep(pause)
                pause = min(1.0, 2 * pause)
                if stop.is_set():               # another failed meanwhile: this one is not sent again
                    raise

    def _abort_running(self, futures: list, rids: list[str], within: float = 10.0) -> None:
        """Abort the requests whose calls still run, again until they end (a call may reach the router after an
        abort that found nothing), for at most `within` seconds."""
        assert self.client is not None
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            running = [(f, rid) for f, rid in zip(futures, rids, strict=True) if not f.done()]
            if not running:
                return
            for _, rid in running:
                try:
                    self.client.abort(rid)
                except (GenerationError, ValueError):
                    return                             # the router is gone, or this LLM closed: nothing to abort
            wait([f for f, _ in running], timeout=0.1)

    def close(self) -> None:
        """Close the client, then stop the fleet (SIGTERM, its drain; SIGKILL after 60 s)."""
        self.closed = True
        if self.client is not None:
            self.client.close()
        p = self.process
        if p.poll() is None:
            p.terminate()
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self._relay.join(timeout=5)                      # the fleet's last lines (its drain) written
