"""The grammar compiler's sandbox: a child process that compiles each request's grammar before this
process does.

llguidance compiles grammars in native code, which no Python thread can interrupt, and its limits
(lexer fuel, lexer states, grammar size) bound the work of a step's token mask, not compilation: a
choice among very many strings compiles for minutes, and a long chain of JSON schema `$ref`s or of
Lark rules overflows the stack and takes the whole process down. So a grammar is compiled first in a
child process, with a deadline (`GRAMMAR_CHECK_TIMEOUT_S`), a memory cap and half the stack of a
thread here: a grammar that compiles there in time is safe to compile here; one that does not is the
request's error, and the child is killed (past the deadline) or replaced (after a crash).

The child imports nothing but llguidance and the standard library: it starts in a fraction of a
second, at the first check, and serves one check at a time.
"""

from __future__ import annotations

import json
import os
import resource
import select
import subprocess
import sys
import threading
import time

from jaxserve.errors import CompilerCrash

GRAMMAR_CHECK_TIMEOUT_S = 5.0  # a grammar must compile within this, or its request is a 400
CHILD_MEMORY_BYTES = 4 << 30  # the child's address space: a grammar that needs more is refused
CHILD_START_TIMEOUT_S = 60.0  # for the child to import llguidance (a cold disk) and say it is ready
DEFAULT_THREAD_STACK_BYTES = 2 << 20  # glibc's stack for a new thread where the stack size has no limit


def thread_stack_bytes() -> int:
    """The stack a new thread of this process gets: Python's setting, else glibc's default (the
    process's stack limit)."""
    size = threading.stack_size()
    if size:
        return size
    soft, _ = resource.getrlimit(resource.RLIMIT_STACK)
    return DEFAULT_THREAD_STACK_BYTES if soft == resource.RLIM_INFINITY else soft


class GrammarSandbox:
    """The child process, started on the first check and replaced after it fails."""

    def __init__(self):
        self._lock = threading.Lock()  # one check at a time
        self._child: subprocess.Popen | None = None

    def check(self, grammar: str) -> str:
        """llguidance's error for the grammar ("" where it compiles); CompilerCrash where it brings the
        compiler down, TimeoutError where it does not compile within GRAMMAR_CHECK_TIMEOUT_S."""
        timeout = GRAMMAR_CHECK_TIMEOUT_S
        with self._lock:
            if self._child is None or self._child.poll() is not None:
                self._start()
            try:
                reply = _exchange(self._child, json.dumps(grammar).encode() + b"\n", time.monotonic() + timeout)
            except TimeoutError:
                self._stop()
                raise TimeoutError(f"it does not compile within {timeout:g} s") from None
            if reply is None:
                self._stop()
                raise CompilerCrash("it brings the grammar compiler down (nested too deeply, or too large)")
            return json.loads(reply)

    def _start(self) -> None:
        """A new child, once it says it is ready; RuntimeError where it does not start (a broken
        installation: not the request's fault)."""
        # -P: the child's imports never come from this package's directory
        stack = thread_stack_bytes() // 2 & ~0xFFFF  # (whole pages, as thread stacks must be)
        child = subprocess.Popen([sys.executable, "-P", __file__, str(stack)],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)
        os.set_blocking(child.stdin.fileno(), False)
        try:
            ready = _exchange(child, b"", time.monotonic() + CHILD_START_TIMEOUT_S)
        except TimeoutError:
            ready = None
        if ready != b"ready\n":
            _kill(child)
            raise RuntimeError("the grammar sandbox process did not start (its error, if any, is in the log above)")
        self._child = child

    def _stop(self) -> None:
        _kill(self._child)
        self._child = None


def _kill(child: subprocess.Popen) -> None:
    child.kill()
    child.wait()
    child.stdin.close()
    child.stdout.close()


def _exchange(child: subprocess.Popen, request: bytes, deadline: float) -> bytes | None:
    """Send one request line (if any) and read the reply line; None if the child dies first,
    TimeoutError if the deadline passes first."""
    out, into = child.stdin.fileno(), child.stdout.fileno()
    reply = b""
    try:
        while request:
            _wait(out, deadline, write=True)
            try:
                request = request[os.write(out, request):]
            except BlockingIOError:
                continue
        while not reply.endswith(b"\n"):
            _wait(into, deadline)
            piece = os.read(into, 1 << 16)
            if not piece:
                return None
            reply += piece
    except (BrokenPipeError, ConnectionResetError):
        return None
    return reply


def _wait(fd: int, deadline: float, write: bool = False) -> None:
    fds = ([], [fd]) if write else ([fd], [])
    if not any(select.select(*fds, [], max(0.0, deadline - time.monotonic()))[:2]):
        raise TimeoutError


_SANDBOX = GrammarSandbox()


def check_grammar(grammar: str) -> str:
    """`GrammarSandbox.check` in the process's one sandbox (see the module's story)."""
    return _SANDBOX.check(grammar)


def _serve(stack_bytes: int) -> None:
    """The child: validate each grammar (a JSON string per line on stdin) in a thread of `stack_bytes`,
    and answer llguidance's error (a JSON string per line on stdout)."""
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    memory = CHILD_MEMORY_BYTES if hard == resource.RLIM_INFINITY else min(hard, CHILD_MEMORY_BYTES)
    resource.setrlimit(resource.RLIMIT_AS, (memory, hard))
    threading.stack_size(stack_bytes)
    import llguidance

    sys.stdout.write("ready\n")
    sys.stdout.flush()
    for line in sys.stdin.buffer:
        grammar, errors = json.loads(line), []
        worker = threading.Thread(target=lambda: errors.append(llguidance.LLMatcher.validate_grammar(grammar)))
        worker.start()
        worker.join()
        sys.stdout.write(json.dumps(errors[0] if errors else "the grammar compiler failed") + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    _serve(int(sys.argv[1]))
