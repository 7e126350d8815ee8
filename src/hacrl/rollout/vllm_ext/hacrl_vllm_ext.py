"""Methods hacrl adds to each vLLM worker (``worker_extension_cls``), run in vLLM's engine
process through ``collective_rpc``. Imported by vLLM in its own environment: nothing from hacrl.

This directory (and only it) is put on the vLLM worker's ``PYTHONPATH``; the module has a
name no other package uses, so it shadows nothing of vLLM's.
"""

from __future__ import annotations


class HacrlWorkerExtension:
    """Mixed into vLLM's worker class (``self`` is the worker)."""

    def hacrl_reload(self, weights_path: str) -> int:
        """Reload the weights in place from ``weights_path``, then rebuild what the reload leaves
        stale: an output head that shares the input embedding's matrix (tied embeddings).

        vLLM's in-place reload loads each layer afresh and re-runs its post-load processing, but
        a tied output head loads nothing (its weight is the embedding's), so its processed form
        (on the CPU, a oneDNN handle packed from the old matrix) kept the old weights: measured
        here on SmolLM2-135M, in-place reload gave log-probs 0.2 away from a fresh load. Rerun for
        every head whose weight is an embedding's, the reload is bit for bit a fresh load (the
        same test: 0.0). Returns the number of heads rebuilt.
        """
        from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

        self.reload_weights(weights_path=weights_path)  # the worker's: under its vLLM config
        model = self.model_runner.get_model()
        embeds = {id(m.weight) for m in model.modules()
                  if isinstance(m, VocabParallelEmbedding) and not isinstance(m, ParallelLMHead)}
        rebuilt = 0
        for m in model.modules():
            if isinstance(m, ParallelLMHead) and id(m.weight) in embeds:
                m.quant_method.process_weights_after_loading(m)
                rebuilt += 1
        return rebuilt
