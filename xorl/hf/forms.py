"""Which transformers code an xorl kernel stands in for, read from transformers' own source.

``xorl.hf.apply`` puts a kernel in place of a module's computation only where it computes the same
thing. Class names do not say that (133 classes carry transformers' "RMSNorm" kernel mark with one
formula; GptOssRMSNorm, unmarked, rounds after the weight product; GemmaRMSNorm multiplies by
``1 + weight``), so the check is on the code itself: the statements of the class's ``forward`` (or
of a module-level function), parsed and printed back by ``ast`` (comments, docstrings and layout
dropped), compared with the forms below, which are the ones xorl's kernels compute exactly. A
class whose code is none of them is left stock or refused (xorl/hf/apply.py says which), never
run on a kernel that would change its numbers. The check runs once per class (cached).
"""

from __future__ import annotations

import ast
import functools
import inspect
import sys
import textwrap


def _statements(fn_node: ast.FunctionDef) -> str:
    body = [s for s in fn_node.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    return "\n".join(ast.unparse(s) for s in body)


def _parse_function(source: str) -> ast.FunctionDef:
    node = ast.parse(textwrap.dedent(source)).body[0]
    if not isinstance(node, ast.FunctionDef):
        raise TypeError(f"not a function definition: {source[:60]!r}")
    return node


def _form(template: str) -> str:
    return _statements(_parse_function(template))


@functools.cache
def method_node(cls: type, name: str = "forward") -> ast.FunctionDef | None:
    """The parsed def of ``cls.<name>`` as the class resolves it (inherited, decorators unwrapped),
    or None where its source cannot be read (a C function, a lambda, generated code)."""
    fn = inspect.unwrap(getattr(cls, name))
    try:
        return _parse_function(inspect.getsource(fn))
    except (OSError, TypeError, SyntaxError, IndexError):
        return None


def method_form(cls: type, name: str = "forward") -> str | None:
    node = method_node(cls, name)
    return None if node is None else _statements(node)


@functools.cache
def _module_functions(module_name: str) -> dict[str, ast.FunctionDef]:
    module = sys.modules[module_name]
    tree = ast.parse(inspect.getsource(module))
    return {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}


def function_form(module_name: str, name: str) -> str | None:
    """The statements of the module-level ``def name`` in ``module_name``'s source, or None."""
    try:
        node = _module_functions(module_name).get(name)
    except (OSError, TypeError, KeyError):
        return None
    return None if node is None else _statements(node)


# RMSNorm: transformers' Llama form (xorl_kernels.rms_norm computes it step for step) and gpt-oss's
# (the weight product taken in fp32, then rounded: rms_norm of the fp32 input, then the cast).
NORM_LLAMA = _form('''
def forward(self, hidden_states):
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    return self.weight * hidden_states.to(input_dtype)
''')
NORM_GPT_OSS = _form('''
def forward(self, hidden_states):
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    return (self.weight * hidden_states).to(input_dtype)
''')

# RoPE, the function transformers' "rotary_pos_emb" kernel mark wraps: rotate-half on the whole head
# (cos / sin [..., head_dim]), and gpt-oss's split halves with half-width cos / sin. Each with its helper.
ROPE_ROTATE_HALF = _form('''
def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed
''')
ROTATE_HALF = _form('''
def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)
''')
ROPE_GPT_OSS = _form('''
def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = _apply_rotary_emb(q, cos, sin)
    k_embed = _apply_rotary_emb(k, cos, sin)
    return q_embed, k_embed
''')
APPLY_ROTARY_EMB_GPT_OSS = _form('''
def _apply_rotary_emb(x, cos, sin):
    first_half, second_half = torch.chunk(x, 2, dim=-1)
    first_ = first_half * cos - second_half * sin
    second_ = second_half * cos + first_half * sin
    return torch.cat((first_, second_), dim=-1)
''')

# The gated MLP (dense layers, shared experts): down(act(gate(x)) * up(x)).
MLP_GATED = _form('''
def forward(self, x):
    down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
    return down_proj
''')

# The pre-norm decoder block, with the self-attention call's keyword list taken out (families pass
# different ones: decoder_layer_form returns it); gpt-oss's MLP returns (hidden, router scores).
_DECODER = '''
def forward(self, hidden_states):
    residual = hidden_states
    hidden_states = self.input_layernorm(hidden_states)
    hidden_states, _ = self.self_attn()
    hidden_states = residual + hidden_states
    residual = hidden_states
    hidden_states = self.post_attention_layernorm(hidden_states)
    {mlp} = self.mlp(hidden_states)
    hidden_states = residual + hidden_states
    return hidden_states
'''
DECODER_PRE_NORM = _form(_DECODER.format(mlp="hidden_states"))
DECODER_PRE_NORM_MLP_TUPLE = _form(_DECODER.format(mlp="hidden_states, _"))


def decoder_layer_form(cls: type) -> tuple[str, tuple[str, ...], tuple[str, ...]] | None:
    """(form, the keyword names its self_attn call passes as ``name=name`` besides hidden_states, the
    forward's parameter names after ``self, hidden_states``), or None when the forward is not readable
    or its self_attn call passes anything other than its own arguments by name and ``**kwargs``."""
    node = method_node(cls)
    if node is None or node.args.kwarg is None:
        return None
    node = ast.parse(ast.unparse(node)).body[0]  # a copy to edit
    params = tuple(a.arg for a in node.args.args)
    if params[:2] != ("self", "hidden_states"):
        return None
    keywords: list[str] = []
    for call in ast.walk(node):
        if (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "self_attn"
                and isinstance(call.func.value, ast.Name) and call.func.value.id == "self"):
            if call.args:
                return None
            for kw in call.keywords:
                if kw.arg is None and isinstance(kw.value, ast.Name) and kw.value.id == node.args.kwarg.arg:
                    continue  # **kwargs: passed on as it came
                if kw.arg == "hidden_states" and isinstance(kw.value, ast.Name) and kw.value.id == kw.arg:
                    continue  # the normed states (the form checks where they come from)
                if kw.arg not in params[2:] or not (isinstance(kw.value, ast.Name) and kw.value.id == kw.arg):
                    return None
                keywords.append(kw.arg)
            call.keywords = []
    return _statements(node), tuple(keywords), params[2:]
