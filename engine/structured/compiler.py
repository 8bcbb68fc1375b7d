"""Compile each distinct constraint once, off the step loop, into a bounded cache.

Compiling is llguidance building the grammar's lexer and parser tables against the vocabulary
(a nested JSON schema: ≈ 2 ms on 2 CPU cores; a large one can take much longer). The service
calls `GrammarCompiler.compile` on a worker thread before it queues the request, so a request
whose grammar is still compiling is not yet in the engine (it holds no row and no block), and a
constraint that does not compile is refused (400) before it is queued.

The result, a `CompiledGrammar`, holds one prototype `llguidance.LLMatcher` in its start state;
each sample that follows it gets its own copy (`new_matcher`, a deep copy: microseconds). The
cache is keyed by `ConstraintSpec.canonical_key`, holds at most `capacity` grammars and evicts
the least recently used; concurrent requests for the same key wait for one compilation.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from engine.structured.spec import ConstraintError, ConstraintSpec
from engine.structured.vocab import llg_tokenizer

# Compiled grammars kept; each is a few hundred KiB at most for typical schemas.
DEFAULT_CAPACITY = 256


@dataclass(frozen=True, slots=True)
class CompiledGrammar:
    """A constraint compiled against the served vocabulary.

    Attributes:
        spec: what was compiled.
        prototype: an `llguidance.LLMatcher` in its start state (never advanced; copied per row).
        vocab_size: tokens of the vocabulary the masks cover.
        eos_token_id: the end-of-sequence id (allowed only where the grammar may end).
        compile_s: seconds the compilation took.
    """

    spec: ConstraintSpec
    prototype: Any
    vocab_size: int
    eos_token_id: int
    compile_s: float

    def new_matcher(self) -> Any:
        """A fresh matcher at the grammar's start, for one sample."""
        return self.prototype.deep_copy()


@dataclass(slots=True)
class CompilerStats:
    """Counters of a `GrammarCompiler`.

    Attributes:
        hits: compile calls answered from the cache (or by waiting for a compilation in flight).
        misses: compilations run.
        failures: constraints that did not compile.
        compile_s: seconds spent compiling, in all.
    """

    hits: int = 0
    misses: int = 0
    failures: int = 0
    compile_s: float = 0.0


@dataclass
class GrammarCompiler:
    """Constraints → `CompiledGrammar`, each distinct one compiled once (thread-safe).

    Args:
        tokenizer: the served model's tokenizer (`engine.structured.vocab.llg_tokenizer`); its
            llguidance form is built on first use (≈ 0.2 s).
        capacity: compiled grammars kept (least recently used evicted).
    """

    tokenizer: Any
    capacity: int = DEFAULT_CAPACITY
    stats: CompilerStats = field(default_factory=CompilerStats)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _cache: OrderedDict = field(default_factory=OrderedDict, repr=False)
    _llg: Any = field(default=None, repr=False)

    def compile(self, spec: ConstraintSpec) -> CompiledGrammar:
        """The compiled grammar of `spec`, from the cache or compiled now (blocking).

        Raises:
            ConstraintError: naming `spec.field`: llguidance refuses the constraint (the reason is
                its message), or the served model cannot be constrained (no end-of-sequence token).
        """
        key = spec.canonical_key
        owner = False
        with self._lock:
            entry = self._cache.get(key)
            if entry is not None:
                self._cache.move_to_end(key)
                self.stats.hits += 1
            else:
                entry = Future()
                self._cache[key] = entry
                self.stats.misses += 1
                while len(self._cache) > self.capacity:
                    self._cache.popitem(last=False)
                owner = True
        if not owner:
            return entry.result()           # cached, or compiling on another thread: wait for it
        try:
            compiled = self._compile(spec)
        except BaseException as exc:
            with self._lock:
                self.stats.failures += 1
                if self._cache.get(key) is entry:
                    del self._cache[key]        # a failure is not cached: the next one re-reports it
            entry.set_exception(exc)
            raise
        with self._lock:
            self.stats.compile_s += compiled.compile_s
        entry.set_result(compiled)
        return compiled

    def cached(self, spec: ConstraintSpec) -> bool:
        """Whether `spec`'s grammar is compiled and in the cache."""
        with self._lock:
            entry = self._cache.get(spec.canonical_key)
            return entry is not None and entry.done() and entry.exception() is None

    def _compile(self, spec: ConstraintSpec) -> CompiledGrammar:
        import llguidance

        t0 = time.perf_counter()
        llg = self._vocabulary(spec)
        grammar = spec.to_grammar()
        matcher = llguidance.LLMatcher(llg, grammar, log_level=0)
        if matcher.is_error():
            raise ConstraintError(spec.field, matcher.get_error())
        return CompiledGrammar(spec, matcher, llg.vocab_size, llg.eos_token, time.perf_counter() - t0)

    def _vocabulary(self, spec: ConstraintSpec):
        with self._lock:
            if self._llg is None:
                try:
                    self._llg = llg_tokenizer(self.tokenizer)
                except ValueError as e:
                    raise ConstraintError(spec.field, f"constraints are not available: {e}") from None
            return self._llg
