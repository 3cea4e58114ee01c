"""Where transformers has no kernel hook, xorl.hf.apply acts on the instance: this is the one file that does.

transformers' kernel mapping (xorl/hf/layers.py) reaches the modules it marks: the RMSNorm classes
and the rotary function. It marks nothing else that xorl fuses, so these patches act on one loaded
model's modules, never on a transformers class or function, and each records how to undo itself
(``undo``, run in reverse by ``XorlPatches.remove``), leaving the modules as they were, bit for bit:

- RMSNorm classes transformers does not mark (gpt-oss's): the module's ``forward`` bound on the
  instance (``module.forward = MethodType(...)``, the same act as kernels' ``kernelize``).
- The gated MLP (``down(act(gate(x)) * up(x))`` with SiLU: dense layers, shared experts): its forward
  on the instance, with ``xorl_kernels.swiglu`` in the middle. No class of it is marked.
- The residual add fused into the block's second norm (``rms_norm(attn_out, residual=...)`` returns
  the normed states and the new residual in one pass): the add lives in the decoder layer's forward,
  so the layer's forward is bound on the instance, for the pre-norm block forms xorl/hf/forms.py
  reads from the class's source (its self-attention call's keywords included).
- The fused loss (xorl/hf/loss.py): the lm_head's forward on the instance (lazy logits while the
  model's forward has labels in training), a forward pre-hook and an always-called forward hook on
  the model (which tell the head when), and the model's ``loss_function`` through its own setter.
- FP8 linears, as torchao's ``convert_to_float8_training``: ``nn.Linear`` children replaced by
  ``xorl.nn.linear.Linear(fp8=recipe)`` holding the same Parameter objects (optimizer state and state
  dict unchanged), chosen by a filter ``(module, fqn) -> bool``; the default leaves out the lm_head,
  routers (a child named ``gate`` / ``router`` / ``*_gate``) and dims not divisible by 16 (FP8 GEMMs).

A module already patched by someone (an instance ``forward``, hooks on a linear to swap) is refused.
"""

from __future__ import annotations

import inspect
from types import MethodType

from torch import nn

from xorl.hf import forms
from xorl.hf.layers import NORM_MARK, XorlApplyError, XorlRMSNorm
from xorl.hf.loss import LazyLogits, causal_lm_loss, check_head, head_loss_sum
from xorl_kernels.activation.op import swiglu
from xorl_kernels.rmsnorm.op import rms_norm

ROUTER_NAMES = ("gate", "router")


def _bind(module: nn.Module, fn, undo: list, name: str) -> None:
    if "forward" in module.__dict__:
        raise XorlApplyError(f"{name} ({type(module).__name__}) already has a forward of its own on the instance "
                             "(kernelized or patched); xorl.hf.apply acts on stock modules only")
    module.forward = MethodType(fn, module)
    undo.append(lambda: module.__dict__.pop("forward", None))


# -- norms transformers does not mark ---------------------------------------------------------------

def _gpt_oss_norm_forward(self, hidden_states):
    """(weight * normed).to(input dtype): rms_norm of the fp32 input (its cast to fp32 is the norm's
    own first step, and the product is then taken in fp32), then the cast."""
    return rms_norm(hidden_states.float(), self.weight, self.variance_epsilon).to(hidden_states.dtype)


def patch_unmarked_norms(model: nn.Module, undo: list) -> list[str]:
    """xorl's rms_norm on RMSNorm modules without transformers' mark, of a form it computes exactly;
    refuses one of another form (Gemma's ``1 + weight``, a norm without variance_epsilon)."""
    found = [(n, m) for n, m in model.named_modules()
             if type(m).__name__.endswith("RMSNorm") and getattr(type(m), "kernel_layer_name", None) != NORM_MARK]
    plan = []
    for name, module in found:
        form = forms.method_form(type(module))
        if form == forms.NORM_GPT_OSS:
            plan.append((name, module, _gpt_oss_norm_forward))
        elif form == forms.NORM_LLAMA:
            plan.append((name, module, XorlRMSNorm.forward))
        else:
            raise XorlApplyError(f"{name} ({type(module).__name__}) is an RMSNorm whose formula xorl's rms_norm does "
                                 "not compute (e.g. Gemma's x * (1 + weight)); pass norm=False")
    for name, module, fn in plan:
        _bind(module, fn, undo, name)
    return [name for name, _, _ in plan]


def is_llama_norm(module: nn.Module) -> bool:
    """Whether a norm computes transformers' Llama form (so rms_norm with a residual stands in)."""
    return forms.method_form(type(module)) == forms.NORM_LLAMA


# -- the gated MLP ----------------------------------------------------------------------------------

def _swiglu_mlp_forward(self, x):
    return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


def _is_silu(act: nn.Module) -> bool:
    from transformers.activations import SiLUActivation

    own_forward = "forward" in getattr(act, "__dict__", {})
    return type(act) in (SiLUActivation, nn.SiLU) and not own_forward


def patch_mlps(model: nn.Module, undo: list, skipped: dict) -> list[str]:
    done = []
    for name, module in model.named_modules():
        if forms.method_form(type(module)) != forms.MLP_GATED:
            continue
        if not _is_silu(module.act_fn):
            skipped[name] = f"its activation is {type(module.act_fn).__name__}, not SiLU: left stock"
            continue
        _bind(module, _swiglu_mlp_forward, undo, name)
        done.append(name)
    return done


# -- the residual add in the block's second norm ---------------------------------------------------------

def _add_norm_decoder_forward(attn_keywords: tuple[str, ...], params: tuple[str, ...], defaults: dict,
                              mlp_tuple: bool):
    """The pre-norm block's forward (forms.DECODER_PRE_NORM*) with the residual add fused into the
    second norm. Arguments reach self_attn as the class's forward passes them: its ``attn_keywords``
    by name, everything else it did not declare as ``**kwargs``."""

    def forward(self, hidden_states, *args, **kwargs):
        if "past_key_values" in kwargs and "cache" in params:  # the class forward's deprecate_kwarg rename
            kwargs["cache"] = kwargs.pop("past_key_values")
        named = dict(defaults)
        named.update(zip(params, args))
        named.update(kwargs)
        extra = {k: v for k, v in named.items() if k not in params}
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, _ = self.self_attn(hidden_states=hidden_states, **{k: named[k] for k in attn_keywords},
                                          **extra)
        norm = self.post_attention_layernorm
        # attn_out + residual: the stock residual + attn_out (one float add, commutative), and its norm.
        hidden_states, residual = rms_norm(hidden_states, norm.weight, norm.variance_epsilon, residual=residual)
        hidden_states = self.mlp(hidden_states)
        if mlp_tuple:
            hidden_states = hidden_states[0]
        return residual + hidden_states

    return forward


def patch_decoder_layers(model: nn.Module, undo: list, skipped: dict) -> list[str]:
    done = []
    for name, module in model.named_modules():
        if not (hasattr(module, "self_attn") and hasattr(module, "post_attention_layernorm")):
            continue
        read = forms.decoder_layer_form(type(module))
        if read is None or read[0] not in (forms.DECODER_PRE_NORM, forms.DECODER_PRE_NORM_MLP_TUPLE):
            skipped[name] = f"{type(module).__name__}'s forward is no pre-norm block form xorl knows: residual add left"
            continue
        if not is_llama_norm(module.post_attention_layernorm):
            skipped[name] = (f"its post_attention_layernorm ({type(module.post_attention_layernorm).__name__}) is not "
                             "the Llama form that rms_norm's residual add computes: residual add left")
            continue
        form, attn_keywords, params = read
        signature = inspect.signature(inspect.unwrap(type(module).forward))
        defaults = {p: signature.parameters[p].default for p in params
                    if signature.parameters[p].default is not inspect.Parameter.empty}
        fn = _add_norm_decoder_forward(attn_keywords, params, defaults, form == forms.DECODER_PRE_NORM_MLP_TUPLE)
        _bind(module, fn, undo, name)
        done.append(name)
    return done


# -- the fused loss ---------------------------------------------------------------------------------------

class _LossGate:
    """Whether the model's forward now running has labels in training (its logits go to the loss)."""

    armed = False


def _lazy_head_forward(gate: _LossGate):
    def forward(self, hidden_states, *args, xorl_loss=None, xorl_logits=False, **kwargs):
        if xorl_loss is not None:  # the loss's call: (labels, ignore_index)
            return head_loss_sum(self, hidden_states, *xorl_loss)
        if gate.armed and not xorl_logits and not args and not kwargs:
            return LazyLogits(hidden_states, self)
        return type(self).forward(self, hidden_states, *args, **kwargs)

    return forward


def patch_loss(model: nn.Module, undo: list) -> str:
    """The fused loss in a causal LM (xorl/hf/loss.py); returns the head's name."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    head = model.get_output_embeddings()
    if head is None:
        raise XorlApplyError(f"{type(model).__name__} has no output embeddings (lm_head); pass loss=False")
    check_head(head)
    if model.loss_function is not ForCausalLMLoss:
        raise XorlApplyError(f"{type(model).__name__}'s loss_function is {model.loss_function!r}, not transformers' "
                             "ForCausalLMLoss, which is what the fused loss computes; pass loss=False")
    name = next(n for n, m in model.named_modules() if m is head)
    params = [p for p in inspect.signature(model.forward).parameters]
    labels_at = params.index("labels") if "labels" in params else None
    gate = _LossGate()

    def arm(module, args, kwargs):
        labels = kwargs.get("labels")
        if labels is None and labels_at is not None and len(args) > labels_at:
            labels = args[labels_at]
        gate.armed = module.training and labels is not None

    def disarm(module, args, output):
        gate.armed = False

    _bind(head, _lazy_head_forward(gate), undo, name)
    hooks = [model.register_forward_pre_hook(arm, with_kwargs=True),
             model.register_forward_hook(disarm, always_call=True)]
    undo.append(lambda: [h.remove() for h in hooks])
    model.loss_function = causal_lm_loss  # PreTrainedModel's setter: the instance's _loss_function
    undo.append(lambda: model.__dict__.pop("_loss_function", None))
    return name


# -- FP8 linears --------------------------------------------------------------------------------------------

def default_fp8_filter(model: nn.Module):
    """torchao's default rule plus the lm_head and routers: (module, fqn) -> whether to run it in FP8."""
    head = model.get_output_embeddings()

    def keep(module: nn.Module, fqn: str) -> bool:
        last = fqn.rsplit(".", 1)[-1]
        router = last in ROUTER_NAMES or last.endswith("_gate")
        return module is not head and not router and module.in_features % 16 == 0 and module.out_features % 16 == 0

    return keep


def _fp8_twin(linear: nn.Linear, recipe: str, fqn: str) -> nn.Module:
    from xorl.nn.linear import Linear

    hooks = (linear._forward_hooks, linear._forward_pre_hooks, linear._backward_hooks, linear._backward_pre_hooks)
    if any(hooks) or "forward" in linear.__dict__:
        raise XorlApplyError(f"{fqn} has hooks or a forward of its own (FSDP, accelerate, a patch): apply fp8 "
                             "before wrapping the model")
    twin = Linear(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta", fp8=recipe)
    twin.weight = linear.weight  # the same Parameter objects: optimizer state and checkpoints carry over
    twin.bias = linear.bias
    twin.train(linear.training)
    return twin


def swap_fp8_linears(model: nn.Module, recipe: str, fp8_filter, undo: list) -> list[str]:
    from xorl.nn.linear import check_fp8

    if check_fp8(recipe) == "none":
        return []
    keep = fp8_filter or default_fp8_filter(model)
    plan, twins = [], {}
    for parent_name, parent in model.named_modules():
        for child_name, child in parent.named_children():
            if type(child) is not nn.Linear:
                continue
            fqn = f"{parent_name}.{child_name}" if parent_name else child_name
            if id(child) not in twins:
                twins[id(child)] = _fp8_twin(child, recipe, fqn) if keep(child, fqn) else None
            if twins[id(child)] is not None:
                plan.append((parent, child_name, child, fqn))
    for parent, child_name, child, _ in plan:
        setattr(parent, child_name, twins[id(child)])
        undo.append(lambda p=parent, n=child_name, c=child: setattr(p, n, c))
    return [fqn for *_, fqn in plan]
