"""The target's forward as one compiled graph (`--compile`): torch.compile (Inductor's C++ backend) fuses the
small ops between the weight products into a few loops a layer.

Why: on CPU a one-token decoding step of the default target spends ~30 ms of ~75 ms outside its 121 weight
products, in the ~1,300 eager ops of 30 layers (RMSNorm as six ops, the rotary embedding, residual adds, SiLU x
up) and Python around them. vLLM's CPU build compiles its layers by default and its steps take ~69 ms on the
same weights (docs/BENCHMARKS.md, peer section). Compiled pieces between eager products did not pay (each
compiled call's guards cost more than the ops it saved); the whole forward as one graph does.

`CompiledLayers` is what this forward shares with a compiled EAGLE head (shared/model/compiled_head.py, the
proposer's `--compile`): the decoder layers' twin, the opaque ops and the calls that run a graph for one step.

What stays eager, as opaque custom ops in the graph: the weight products (oneDNN's packed weights are opaque
tensors that the compiler cannot trace, so a product is called with its index in a registry) and the paged
attention with its K/V writes (block tables, token trees and split calls are per-step Python structures; the
op reads them from the step's context). Everything else compiles.

Exactness: the fused RMSNorm, rotary and SiLU round differently from the eager ops (logits within ~1e-4 of the
eager forward's), so a compiled stack is compared with plain decoding by the same compiled forward. As in the
eager forward, a position's logits do not depend on what else the step scores: a one-token step, the same
position among k + 1 scored rows, beside other sequences, all bit for bit equal (tests/unit/test_compiled_forward.py).
The token dimension is marked unbacked so that one graph serves every step size: a one-token step would otherwise
get a graph of its own (the first call compiles: 60 s cold for the default target on two cores, about 20 s from
Inductor's on-disk cache).

bf16 products inside the graph (`products_in_graph`): with bf16 weights on a CPU with AMX, the layers' products
are plain `F.linear`s over the weights, which the compiler freezes as constants and multiplies with its own C++
GEMM templates (`freezing`, `max_autotune`, the CPP backend only): AMX micro-kernels built for these shapes,
called from the graph's C++ with no per-call dispatch, where each of oneDNN's calls cost ~35-75 us before any
arithmetic and ran in blocks of 16 rows; the LM head's product is a small graph of its own. On the default target
(Xeon with AMX, 2 threads) a one-token forward took 0.64-0.71x the eager bf16 one, 8 sequences scoring 5 tokens
0.56-0.61x (docs/BENCHMARKS.md, "bf16 products made by the compiled graph"). Exactness holds as for the opaque
products: a template's row is computed alike whatever the row count (a position's logits bit for bit the same
alone, among scored rows and beside prefills of up to 500 rows on the default target); only the CPP backend is
allowed, since autotuning against ATen's product could pick oneDNN's, whose bf16 rows depend on the row count. The
price is start-up: ~130 s on two cores for the default target, every start (frozen graphs are not kept in
Inductor's cache). fp32 keeps the opaque products: MKL's packed ones were slower than the templates at one row
(58.6 against 53.0 ms a step) but much faster at the 40 rows of 8 sequences scoring 5 tokens (152 against 211 ms).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch._inductor.config as inductor_config
import torch.nn.functional as F

from shared.model import native, tiles
from shared.model.attention import AttentionMetadata, paged_attention, write_kv
from shared.model.mkl_product import ORIGIN
from shared.model.parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    amx_tiles,
    linear,
    out_features,
)
from shared.model.rope import apply_rotary

if TYPE_CHECKING:
    from shared.model.llama import DecoderLayer, LlamaModel


@dataclass(frozen=True)
class _Product:
    weight: torch.Tensor  # plain or packed (parallel.pack_weight)
    bias: torch.Tensor | None
    out_features: int


@dataclass
class _StepContext:
    backend: Any  # the owner's paged attention (TorchPagedAttention, CpuPagedAttention or FlashPagedAttention)
    scale: float  # the attention's softmax scale, every layer's
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    meta: AttentionMetadata | None = None


_PRODUCTS: list[_Product] = []  # every compiled model's weights, by index: the graph holds the index only
_CONTEXTS: dict[int, _StepContext] = {}  # per compiled model or head: the step being run (caches, metadata)
_model_ids = itertools.count()


# The opaque ops are registered through torch.library.Library rather than the torch.library.custom_op decorator:
# over the attention's body (185-450 us), the decorator's Python wrapper cost 25-45 us a call at batch 1 and
# 67-107 at batch 8, a Library op's dispatch 12-13 and 26-43 (2 cores, AMX host, 2026-12-03): in one run 30 and
# 64 us saved a call, at each of a step's 30 layers.
_LIBRARY = torch.library.Library("specdec", "DEF")
_LIBRARY.define("product(Tensor x, int index) -> Tensor")
# K/V are written into the caches, which the graph never reads: nothing it computes depends on that mutation.
_LIBRARY.define("paged_attention(Tensor q, Tensor k, Tensor v, int model_id, int layer) -> Tensor")


def _product_impl(x: torch.Tensor, index: int) -> torch.Tensor:
    entry = _PRODUCTS[index]
    return linear(x, entry.weight, entry.bias)


def _attention_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, model_id: int, layer: int) -> torch.Tensor:
    context = _CONTEXTS[model_id]
    assert context.kv_caches is not None and context.meta is not None
    k_cache, v_cache = context.kv_caches[layer]
    write_kv(k_cache, v_cache, k, v, context.meta)
    return paged_attention(context.backend, q, k_cache, v_cache, context.meta, context.scale).contiguous()


_LIBRARY.impl("product", _product_impl, "CompositeExplicitAutograd")
_LIBRARY.impl("paged_attention", _attention_impl, "CompositeExplicitAutograd")


@torch.library.register_fake("specdec::product")
def _(x: torch.Tensor, index: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], _PRODUCTS[index].out_features)


@torch.library.register_fake("specdec::paged_attention")
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, model_id: int, layer: int) -> torch.Tensor:
    return torch.empty_like(q)


_product = torch.ops.specdec.product.default
_attention = torch.ops.specdec.paged_attention.default


# Inductor's options for a graph whose bf16 products it makes itself: weights frozen as constants (laid out for its
# micro-kernels once, at compile), products by its C++ GEMM templates and nothing else (see the module's docstring).
TEMPLATE_OPTIONS: dict[str, Any] = {
    "freezing": True,
    "max_autotune": True,
    "max_autotune_gemm_backends": "CPP",
}


def products_in_graph(dtype: torch.dtype) -> bool:
    """Whether a compiled forward in `dtype` multiplies inside its graph (C++ GEMM templates) rather than through
    opaque packed products: bf16 on a CPU with AMX, where it was measured to pay. Not with AVX-512 BF16 and no AMX
    (AMD Zen 4): there the templates' fp32 micro-kernels made a one-token step at batch 1 0.85x the time of the eager
    forward with the tiled kernel's products (tiles.py), five tokens at batch 8 4.23x (compile_bench)."""
    return dtype == torch.bfloat16 and amx_tiles()


def has_cpp_compiler() -> bool:
    """Inductor's CPU backend builds its kernels with the system's C++ compiler (`$CXX`, else g++ or clang++)."""
    return native.compiler() is not None


def check_can_compile(device: torch.device) -> None:
    if device.type != "cpu":
        raise ValueError("--compile runs on CPU only (Inductor's C++ backend); on CUDA leave it off")
    if not has_cpp_compiler():
        raise ValueError("--compile needs a C++ compiler for Inductor's CPU kernels (g++ or clang++ on PATH, or $CXX)")


class CompiledLayers:
    """What a compiled target and a compiled EAGLE head share: Llama decoder layers traced into a graph, with the
    paged attention (and, unless the graph makes its own, the products) as the opaque ops above, and the calls that
    run such a graph for one step."""

    def __init__(self, backend: Any, layers: list[DecoderLayer], dtype: torch.dtype, templates: bool | None) -> None:
        self.layers = layers
        self.templates = products_in_graph(dtype) if templates is None else templates
        if self.templates:
            _unpack_layers(self.layers, dtype)
        self.model_id = next(_model_ids)
        _CONTEXTS[self.model_id] = _StepContext(backend, self.layers[0].self_attn.scale)
        self.products = [
            [
                self._register(layer.self_attn.qkv_proj.weight, layer.self_attn.qkv_proj.bias),
                self._register(layer.self_attn.o_proj.weight),  # its bias is added after the product, as eager
                self._register(layer.mlp.gate_up_proj.weight, layer.mlp.gate_up_proj.bias),
                self._register(layer.mlp.down_proj.weight),
            ]
            for layer in self.layers
        ]

    @staticmethod
    def _register(weight: torch.Tensor, bias: torch.Tensor | None = None) -> int:
        _PRODUCTS.append(_Product(weight, bias, out_features(weight)))
        return len(_PRODUCTS) - 1

    def _run(
        self,
        graph: Callable,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]] | None,
        meta: AttentionMetadata | None,
        *args: torch.Tensor,
    ) -> Any:
        """graph(*args) with the step's caches and metadata where the attention op reads them; every arg's first
        dimension (the step's rows) unbacked: one graph for every step size, where a one-row step would otherwise
        get a graph of its own."""
        context = _CONTEXTS[self.model_id]
        context.kv_caches, context.meta = kv_caches, meta
        for arg in args:
            torch._dynamo.decorators.mark_unbacked(arg, 0)
        try:
            if not self.templates:
                return graph(*args)
            # Compiling happens inside a call (the first, or one whose guards fail), and freezing is read before
            # Inductor's own options apply: the settings are the process's for the call, and only for it.
            with inductor_config.patch(TEMPLATE_OPTIONS):
                return graph(*args)
        finally:
            context.kv_caches = context.meta = None

    def _layer(self, i: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Decoder layer i of `llama.DecoderLayer.forward`'s twin, traced: x [T, hidden] -> [T, hidden]."""
        layer = self.layers[i]
        attention, mlp = layer.self_attn, layer.mlp
        heads, kv_heads, head_dim = attention.num_heads, attention.num_kv_heads, attention.head_dim
        qkv, out_proj, gate_up, down = self.products[i]
        qk, v = self._product(layer.input_layernorm(x), qkv, attention.qkv_proj).split(
            [(heads + kv_heads) * head_dim, kv_heads * head_dim], dim=-1
        )
        qk = apply_rotary(qk.view(-1, heads + kv_heads, head_dim), cos, sin)  # [T, heads + kv_heads, D]
        q, k = qk[:, :heads].contiguous(), qk[:, heads:].contiguous()
        out = _attention(q, k, v.reshape(-1, kv_heads, head_dim).contiguous(), self.model_id, i)  # [T, H, D]
        out = self._product(out.reshape(out.shape[0], -1), out_proj, attention.o_proj)
        x = x + _row_bias(out, attention.o_proj.bias)
        gate, up = self._product(layer.post_attention_layernorm(x), gate_up, mlp.gate_up_proj).split(
            [mlp.inter, mlp.inter], dim=-1
        )
        down_out = self._product(F.silu(gate) * up, down, mlp.down_proj)
        return x + _row_bias(down_out, mlp.down_proj.bias)

    def _product(self, x: torch.Tensor, index: int, module: ColumnParallelLinear | RowParallelLinear) -> torch.Tensor:
        """x [T, in] @ the module's weight.T; a column-parallel layer's bias with it, a row-parallel one's added
        after, as eager."""
        return self._matmul(x, index, module.weight, module.bias if isinstance(module, ColumnParallelLinear) else None)

    def _matmul(
        self, x: torch.Tensor, index: int, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x [T, in] @ weight.T + bias: inside the graph (the plain weight, frozen) or through the opaque op
        (registry entry `index`, which holds the same weight and bias)."""
        if self.templates:
            return F.linear(x, weight, bias)
        return _product(x, index)


class CompiledForward(CompiledLayers):
    """`LlamaModel.forward_with_layers` as one compiled graph, for a model at tensor-parallel degree 1 on CPU."""

    def __init__(self, model: LlamaModel, templates: bool | None = None) -> None:
        if model.tp.world_size > 1:
            raise ValueError("--compile needs --tensor-parallel-size 1 (the ranks' all-reduces stay eager)")
        check_can_compile(model.embed_tokens.weight.device)
        super().__init__(model.backend, list(model.layers), model.embed_tokens.weight.dtype, templates)  # type: ignore[arg-type]
        self.model = model
        self.graphs: dict[tuple[int, ...], Callable] = {}  # per set of captured layers: constants in the graph
        self.logits_graph: Callable | None = None  # the LM head's product, where the graph makes the products
        if self.templates:
            model.packed_lm_head = None  # the LM head's graph reads the plain weight (the tied embedding's)

    def __call__(
        self,
        input_ids: torch.Tensor,  # [T]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        layers: tuple[int, ...],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        graph = self.graphs.get(layers)
        if graph is None:
            graph = self.graphs[layers] = torch.compile(self._body_for(layers), dynamic=True, fullgraph=True)
        # The model's backend as it is now: a runner picks it after the model may have been compiled.
        _CONTEXTS[self.model_id].backend = self.model.backend
        return self._run(graph, kv_caches, meta, input_ids, meta.positions)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, vocab] fp32
        """The LM head's product by a template of its own, where the graph makes the layers' products: oneDNN's
        bf16 blocks of 16 rows read the [vocab, hidden] weight once a block (three times for the 40 rows of 8
        sequences scoring 5 tokens), a template once."""
        if self.logits_graph is None:
            self.logits_graph = torch.compile(self._logits_body, dynamic=True, fullgraph=True)
        return self._run(self.logits_graph, None, None, hidden)

    def _logits_body(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.model.lm_head_weight).float()

    def _body_for(self, layers: tuple[int, ...]) -> Callable:
        """The forward capturing `layers`, closed over them: the compiler keeps a closure's ints as constants
        (passed as arguments, they would become symbolic sizes)."""

        def body(input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
            return self._body(input_ids, positions, layers)

        return body

    def _body(
        self, input_ids: torch.Tensor, positions: torch.Tensor, layers: tuple[int, ...]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The twin of `LlamaModel.forward_with_layers` and its layers' forwards (shared/model/llama.py), with
        the attention and (unless the graph makes its own) the products as the custom ops above: the eager modules
        take the step's metadata as an argument, which the compiler would guard on at every step. A change to one
        is a change to the other; tests/unit/test_compiled_forward.py holds them within 1e-4 of each other."""
        model = self.model
        x = F.embedding(input_ids, model.embed_tokens.weight)  # [T, hidden]
        # apply_rotary, not llama's apply_rotation: torch.roll cannot be traced with the step's unbacked row count
        cos, sin = model.rotary(positions, x.dtype)
        outputs: list[torch.Tensor] = []  # each decoder layer's output
        for i in range(len(self.layers)):
            x = self._layer(i, x, cos, sin)
            outputs.append(x)
        final = model.norm(x)
        captured = [final if i == -1 else outputs[i] for i in layers]
        return final, torch.cat(captured, dim=-1) if captured else None


def _unpack_layers(layers: list[DecoderLayer], dtype: torch.dtype) -> None:
    """The layers' weights back in torch's plain layout, for the compiler to freeze and lay out for its own
    kernels: the weights packed for oneDNN at load (`pack_weight`), which the eager forward no longer reads once
    the forward is compiled."""
    for layer in layers:
        for module in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            module.weight = plain_weight(module.weight, dtype)


def plain_weight(weight: torch.Tensor, dtype: torch.dtype) -> torch.nn.Parameter:
    """`weight` in torch's plain layout and the model's `dtype` (a weight packed for oneDNN or tiled for our
    kernel unpacked)."""
    if hasattr(weight, ORIGIN) or weight.dtype != dtype:
        raise ValueError(
            "products in the compiled graph need the weights in the model's dtype: these were packed as "
            "fp32 copies (a CPU without half kernels); build the model or head unpacked (pack=False)"
        )
    if weight.is_mkldnn:
        return torch.nn.Parameter(weight.to_dense(), requires_grad=False)
    if tiles.is_packed(weight):
        return torch.nn.Parameter(tiles.unpack(weight), requires_grad=False)
    return weight if isinstance(weight, torch.nn.Parameter) else torch.nn.Parameter(weight, requires_grad=False)


def _row_bias(out: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return out if bias is None else out + bias
