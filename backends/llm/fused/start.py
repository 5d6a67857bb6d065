"""A runner's fused step: probed, built and checked against transformers once, rebuilt when the
tensors it points at are replaced, and chosen step by step."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from backends.llm.attention import AttentionParams
from backends.llm.fused.decoder import FusedDecoder, unsupported_reason
from backends.llm.fused.kernel import fused_kernel
from backends.llm.fused.step import FusedStep, runs_fused
from backends.llm.fused.threads import ThreadChoice
from backends.llm.kernel_settings import KernelSettings
from backends.llm.scheduler import SchedulerOutput
from backends.threads import cores

log = logging.getLogger(__name__)

# Tokens of the check chunk: enough for attention over several keys in every layer.
CHECK_TOKENS = 7
# Largest difference from transformers' logits accepted, relative to their largest magnitude:
# summation order alone stays near 1e-6; a misread layer is off by order one.
CHECK_TOLERANCE = 1e-3

# The transformers path on one chunk of fresh tokens at positions 0.., in cache slots 0..:
# (tokens, slots, block ids, a dict to record each layer's AttentionParams into) -> logits
# of every token (n, V).
Reference = Callable[[list[int], list[int], list[int], dict[int, AttentionParams]], torch.Tensor]


def start_fused(
    model: Any,
    kv_caches: list[torch.Tensor],
    reference: Reference,
    *,
    max_context: int,
    max_rows: int,
    threads: int,
    settings: KernelSettings,
) -> tuple[FusedDecoder | None, list[AttentionParams], str | None]:
    """(decoder, each layer's attention parameters, None), or (None, [], why not).

    Runs one chunk through transformers (`reference`, which also records what every layer's
    attention receives) and through the fused step, in the KV cache's first blocks (no
    sequence owns them yet; whoever gets them later writes before reading), and compares."""
    reason = unsupported_reason(model)
    if reason is not None:
        return None, [], reason
    kernel = fused_kernel(settings)
    if kernel is None:
        return None, [], "the native kernel could not be built"
    _, num_blocks, block_size, _, _ = kv_caches[0].shape
    n = min(CHECK_TOKENS, num_blocks * block_size, max_rows, max_context)
    vocab = model.lm_head.out_features
    tokens = [(7919 * i + 11) % vocab for i in range(n)]
    slots = list(range(n))
    blocks = list(range(-(-n // block_size)))
    recorded: dict[int, AttentionParams] = {}
    layers = len(model.model.layers)
    step = FusedStep(tokens, list(range(n)), slots, blocks, [0] * n, list(range(1, n + 1)), slots)
    try:
        expected = reference(tokens, slots, blocks, recorded)
        if sorted(recorded) != list(range(layers)):
            return None, [], "the attention probe did not see every layer"
        params = [recorded[i] for i in range(layers)]
        if any(p.softcap for p in params):
            return None, [], "soft-capped attention"
        decoder = FusedDecoder(
            kernel,
            model,
            kv_caches,
            params,
            max_context=max_context,
            max_rows=max_rows,
            threads=threads,
        )
        got = decoder(step)
    except (ValueError, RuntimeError, TypeError, AttributeError) as e:
        # A layout the decoder does not take (a weight not float32, a bias in another
        # dtype, ...): the model keeps the transformers path, which takes anything.
        log.warning("the fused step cannot run this model: %s", e)
        return None, [], f"the fused step cannot run it: {e}"
    scale = max(1.0, float(expected.abs().max()))
    error = float((got - expected).abs().max()) / scale
    if not error <= CHECK_TOLERANCE:  # NaN included
        log.warning("the fused step disagrees with transformers (%.3g); not used", error)
        return None, [], f"its logits differ from transformers' by {error:.3g} (relative)"
    return decoder, params, None


class FusedPath:
    """What a model runner keeps of the fused step: `start` once (with a fresh KV cache),
    then `decoder_for` each step; `forget` whenever the weights or the KV cache are about to
    be replaced (the decoder points at them), and the next step builds it anew from the
    attention parameters probed at the start (no second check: the cache may hold requests'
    prefixes by then)."""

    def __init__(
        self,
        model: Any,
        reference: Reference,
        *,
        max_context: int,
        max_rows: int,
        settings: KernelSettings,
    ) -> None:
        self._model = model
        self._reference = reference
        self._max_context = max_context
        self.max_rows = max_rows
        self._settings = settings
        self._attention: list[AttentionParams] = []
        # Threads a step runs on at most (None: the machine's cores; `limit_threads`).
        self.max_threads: int | None = None
        # Each step's thread count, all or half, by what has run faster lately at its size
        # (`adaptive` False: always all).
        self.thread_choice = ThreadChoice()
        self.adaptive = True
        self.decoder: FusedDecoder | None = None
        self._scratch_bytes = 0  # the last decoder's, while none is built
        self.steps = 0  # steps run fused

    @property
    def scratch_bytes(self) -> int:
        """Bytes the fused step holds (its scratch, rotary tables), counted from its start on,
        between a `forget` and the next step's rebuild too; 0 while it is off."""
        if self.decoder is not None:
            return self.decoder.scratch_bytes
        return self._scratch_bytes if self._attention else 0

    def start(self, kv_caches: list[torch.Tensor]) -> str | None:
        """Probe, build and check; None when steps may run fused, else why not (logged)."""
        self.decoder, self._attention, reason = start_fused(
            self._model,
            kv_caches,
            self._reference,
            max_context=self._max_context,
            max_rows=self.max_rows,
            threads=self._threads(),
            settings=self._settings,
        )
        if reason is not None:
            log.info("steps run through the transformers modules: %s", reason)
        return reason

    def limit_threads(self, threads: int) -> None:
        """Run steps on at most `threads` threads: a model whose step is a few microseconds of
        work per thread (a draft model) loses more to the threads' barriers than it gains,
        above all when other processes hold the cores and a thread waits for a descheduled
        one."""
        self.max_threads = max(1, threads)
        if self.decoder is not None:
            self.decoder.threads = min(self.decoder.threads, self.max_threads)

    def _threads(self) -> int:
        return min(cores(), self.max_threads or cores())

    def forget(self) -> None:
        if self.decoder is not None:  # held again once the next step rebuilds it
            self._scratch_bytes = self.decoder.scratch_bytes
        self.decoder = None

    def decoder_for(
        self, output: SchedulerOutput, kv_caches: list[torch.Tensor]
    ) -> FusedDecoder | None:
        """The decoder if this step should run fused, else None."""
        if not self._attention or not runs_fused(output, self.max_rows):
            return None
        if self.decoder is None or self.decoder.kv_caches is not kv_caches:
            kernel = fused_kernel(self._settings)
            reason = "the kernel is unavailable" if kernel is None else None
            reason = reason or unsupported_reason(self._model)
            if kernel is not None and reason is None:
                try:
                    self.decoder = FusedDecoder(
                        kernel,
                        self._model,
                        kv_caches,
                        self._attention,
                        max_context=self._max_context,
                        max_rows=self.max_rows,
                        threads=self._threads(),
                    )
                except (ValueError, RuntimeError, TypeError, AttributeError) as e:
                    reason = str(e)
            if reason is not None:
                log.warning("the fused step is off after the model moved: %s", reason)
                self._attention = []
                return None
        self.steps += 1
        decoder = self.decoder
        if decoder is not None:
            decoder.choice = self.thread_choice if self.adaptive else None
        return decoder
