"""The engine shared by the prefill and decode workers (torch; only those two services import it).

    engine.py        Engine: add / step / abort / release / export_blocks; step = schedule -> run -> sample
    api.py           EngineRequest, StepOutput, EngineStats (what the services code against)
    scheduler.py     which tokens of which sequences to compute each step (chunked prefill, preemption)
    block_manager.py free list, ref counts, local prefix cache by chained hash
    kv_cache.py      the paged KV tensor (long-term tier) and per-request state (short-term tier)
    model_runner.py  a step plan -> one flat batch -> logits of the sampled positions
    cuda_graphs.py   decode steps replayed from CUDA graphs (bucketed batch sizes), pinned input staging
    attention.py     attention over the paged cache (torch reference) and its metadata
    ops.py           the model's non-GEMM ops by backend: torch (reference, CPU) or triton (GPU)
    kernels/         Triton kernels: paged decode / prefill attention, RoPE + KV write, RMSNorm, SwiGLU
    sampler.py       greedy / temperature / top-k / top-p, stateless seeded draws (CPU; batched on the GPU)
    random_model.py  random-weight Llama models of real shapes (benchmarks, GPU tests)
    models/          model implementations by architecture (llama)
    loader/          checkpoints by format (gguf, hf) -> config + weights under HF names
"""
