"""The fused CPU step: a Llama-shaped float32 decoder's whole forward in one native call.

At a few tokens a step, a CPU forward is a stream of the weights through the cores, and the
transformers modules add as much again around the products: a few hundred small operators
a step, each a dispatch, a pass over memory and an OpenMP barrier. `csrc/fused_decode.c`
runs the embeddings, every layer (norms, projections, rotary embedding, K/V writes, paged
attention, SwiGLU MLP) and the LM head of the sampled rows in one OpenMP region on the
calling thread's torch threads, reading the model's own weight tensors in place (nothing is
copied, so the footprint is unchanged). At many rows its products run as register tiles
over packed input panels (`csrc/tiles.h`), faster than torch's on the benchmark shapes.

- `decoder`: which models qualify (`unsupported_reason`: a CPU float32 model of a family in
  `FAMILIES` with exactly the expected parts; int8/int4 layers, Gemma-style norms and
  soft-capping do not), and `FusedDecoder`, the kernel pointed at one model's tensors.
- `step`: a scheduler step as rows (`fused_rows`) and whether it should run fused
  (`runs_fused`: no LoRA adapter, prompt chunks short enough).
- `start`: the probe of each layer's attention parameters through the model's own forward,
  and the check of the fused step against transformers on a short chunk before any request
  (`start_fused`); a model that disagrees keeps the transformers path.
- `kernel`: the ctypes side of the C structs.
- `threads`: each step's thread count, all of them or half, whichever has run faster lately
  at the step's size (a core another process holds stalls the threads at their barriers).

The model runner (`backends.llm.model_runner`) owns the decision per step; the runtime key
`fused_step: false` keeps a model on the transformers path.
"""
