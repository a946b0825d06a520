"""A mypy plugin that types a handle's methods from its actor class.

``h.add`` on an ``ActorHandle[Counter]`` is found by the handle's ``__getattr__`` at run time, which
no type checker can follow; this plugin gives it the type of ``Counter.add`` seen from the caller:
``ActorMethod[(k: int), int]`` (``await h.add(2)`` is an ``int``, ``h.add.submit(2)`` an
``asyncio.Future[int]``), a :class:`~rlactors.api.handle.StreamMethod` for a generator method, and a
``GroupMethod[(k: int), int]`` on an ``ActorGroup[Counter]``, and ``(k: int) -> Coroutine[Any, Any,
int]`` on a subclass of ``HandleProxy[Counter]``. A name the class has no public method for is an
error, as it is at run time. Enable it in the mypy configuration::

    [tool.mypy]
    plugins = ["rlactors.mypy"]
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from mypy.errorcodes import ATTR_DEFINED
from mypy.maptype import map_instance_to_supertype
from mypy.nodes import Decorator, FuncDef, TypeInfo
from mypy.plugin import AttributeContext, Plugin
from mypy.subtypes import find_member
from mypy.types import AnyType, CallableType, Instance, Parameters, Type, TypeOfAny, get_proper_type

__all__ = ["plugin"]

HANDLE = "rlactors.api.handle.ActorHandle"
GROUP = "rlactors.api.handle.ActorGroup"
PROXY = "rlactors.api.handle.HandleProxy"


class RlactorsPlugin(Plugin):
    def get_attribute_hook(self, fullname: str) -> Callable[[AttributeContext], Type] | None:
        owner, _, name = fullname.rpartition(".")
        if owner in (HANDLE, GROUP, PROXY) and not name.startswith("_"):
            return functools.partial(_method_type, name=name, owner=owner)
        return None


def plugin(version: str) -> type[Plugin]:
    """mypy's entry point."""
    return RlactorsPlugin


def _method_type(ctx: AttributeContext, *, name: str, owner: str) -> Type:
    handle = get_proper_type(ctx.type)
    if not isinstance(handle, Instance) or handle.type.get(name) is not None:
        return ctx.default_attr_type  # the handle's own attribute (actor_id, name, …)
    base = next((b for b in handle.type.mro if b.fullname == owner), None)
    if base is not None and handle.type is not base:  # a subclass: its actor class is its base's argument
        handle = map_instance_to_supertype(handle, base)
    if not handle.args:
        return ctx.default_attr_type  # no class known
    actor = get_proper_type(handle.args[0])
    if not isinstance(actor, Instance):
        return ctx.default_attr_type  # ActorHandle[Any]: a handle from get_actor() or the wire
    sig = find_member(name, actor, actor)
    sig = get_proper_type(sig) if sig is not None else None
    if not isinstance(sig, CallableType):
        if sig is None:
            msg = f'Actor "{actor.type.name}" has no public method "{name}"'
            ctx.api.fail(msg, ctx.context, code=ATTR_DEFINED)
            return AnyType(TypeOfAny.from_error)
        return ctx.default_attr_type  # overloaded, or not a plain method: left unchecked
    params = Parameters(sig.arg_types, sig.arg_kinds, sig.arg_names, variables=sig.variables)
    ret = get_proper_type(sig.ret_type)
    kind = _kind(actor, name)
    group = owner == GROUP
    if kind in ("asyncgen", "gen"):
        if group or owner == PROXY:
            return ctx.default_attr_type  # a group calls no generator method, a proxy's calls are awaited
        item = ret.args[0] if isinstance(ret, Instance) and ret.args else AnyType(TypeOfAny.unannotated)
        return _instance(ctx, "StreamMethod", [params, item])
    if kind == "async" and isinstance(ret, Instance) and len(ret.args) == 3:
        result = ret.args[2]  # async def f() -> R is a Coroutine[Any, Any, R]
    else:
        result = sig.ret_type
    if owner == PROXY:
        coroutine = ctx.api.named_generic_type(
            "typing.Coroutine", [AnyType(TypeOfAny.special_form)] * 2 + [result]
        )
        return sig.copy_modified(ret_type=coroutine)
    return _instance(ctx, "GroupMethod" if group else "ActorMethod", [params, result])


def _instance(ctx: AttributeContext, name: str, args: list[Type]) -> Type:
    """``rlactors.api.handle.<name>[args]`` (looked up in the module: the package's names may not list it)."""
    module = ctx.api.modules.get("rlactors.api.handle")  # type: ignore[attr-defined]
    sym = module.names.get(name) if module is not None else None
    if sym is None or not isinstance(sym.node, TypeInfo):
        return ctx.default_attr_type
    return Instance(sym.node, args)


def _kind(actor: Instance, name: str) -> str:
    """As rlactors.wire.methods.method_kind says at run time, from the definition."""
    node = actor.type.get_method(name)
    fn = node.func if isinstance(node, Decorator) else node
    if not isinstance(fn, FuncDef):
        return "sync"
    if fn.is_async_generator:
        return "asyncgen"
    if fn.is_coroutine:
        return "async"
    return "gen" if fn.is_generator else "sync"
