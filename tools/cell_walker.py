"""A small interpreter of a notebook's cells that follows plain values and nothing else.

It walks Python's syntax tree statement by statement, as a kernel would run the cells: numbers,
strings, lists, dicts and the chapter's own functions are evaluated for real; anything it is not
told about (a module, a tensor, an object's method) is ``UNKNOWN``, and every operation on
``UNKNOWN`` gives ``UNKNOWN`` again. A subclass decides what the names it cares about mean, by
putting ``Native`` functions and ``Namespace`` objects in the global frame and by overriding the
hooks (``attribute``, ``special_call``, ``import_value``, ``loop_work``, ``scale_loop``).
tools/t4_ledger.py is the one subclass: it follows what the chapters put on a GPU.
"""
from __future__ import annotations

import ast
import itertools
import re
from dataclasses import dataclass

MAGIC = re.compile(r"^(\s*)[%!]")
LOOP_LIMIT = 64  # iterations of one loop walked; the rest are assumed to repeat them


class Unknown:
    """A value the walker does not follow."""

    def __repr__(self) -> str:
        return "?"


UNKNOWN = Unknown()
NOT_HANDLED = object()  # what a hook returns to leave a case to the walker


class Native:
    """A function the walker's owner runs itself: fn(walker, args, kwargs, node)."""

    def __init__(self, fn, name: str = "") -> None:
        self.fn, self.name = fn, name


class Namespace:
    """A module or object stand-in whose attributes are given (anything else is Unknown)."""

    def __init__(self, **attributes) -> None:
        self.attributes = attributes


@dataclass
class Function:
    """A function a cell defined, with its defaults evaluated where it was defined."""

    node: ast.FunctionDef
    defaults: list
    kw_defaults: dict


class Return(Exception):
    def __init__(self, value) -> None:
        self.value = value


class Break(Exception):
    pass


class Continue(Exception):
    pass


def items(iterable) -> list:
    """The first LOOP_LIMIT items of a value the walker can iterate, else one Unknown."""
    if isinstance(iterable, (Unknown, Native, Namespace, Function)) or not hasattr(
            iterable, "__iter__") or isinstance(iterable, (bytes, bytearray)):
        return [UNKNOWN]
    try:
        return list(itertools.islice(iterable, LOOP_LIMIT))
    except Exception:
        return [UNKNOWN]


def length(iterable) -> int:
    """How many items a loop over iterable runs (1 when the walker cannot tell)."""
    try:
        return max(1, len(iterable))
    except Exception:
        return 1


def builtins() -> dict:
    """The builtins a chapter's arithmetic needs, run for real."""
    return {name: Native(lambda walker, a, k, n, f=f: f(*a, **k), name) for name, f in {
        "min": min, "max": max, "int": int, "float": float, "len": len, "range": range,
        "list": list, "dict": dict, "tuple": tuple, "sum": sum, "sorted": sorted,
        "round": round, "abs": abs, "enumerate": enumerate, "zip": zip, "str": str,
        "bool": bool, "set": set, "reversed": reversed, "any": any, "all": all,
        "isinstance": lambda *a: UNKNOWN, "print": lambda *a, **k: None}.items()}


OPERATORS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b,
             ast.Mult: lambda a, b: a * b, ast.Div: lambda a, b: a / b,
             ast.FloorDiv: lambda a, b: a // b, ast.Mod: lambda a, b: a % b,
             ast.Pow: lambda a, b: a ** b, ast.BitOr: lambda a, b: a | b}
COMPARISONS = {ast.Eq: lambda a, b: a == b, ast.NotEq: lambda a, b: a != b,
               ast.Lt: lambda a, b: a < b, ast.LtE: lambda a, b: a <= b,
               ast.Gt: lambda a, b: a > b, ast.GtE: lambda a, b: a >= b,
               ast.Is: lambda a, b: a is b, ast.IsNot: lambda a, b: a is not b,
               ast.In: lambda a, b: a in b, ast.NotIn: lambda a, b: a not in b}


class Walker:
    """Walks cells in one global frame; a running statement's temporaries stay alive."""

    def __init__(self, global_frame: dict) -> None:
        self.frames: list[dict] = [global_frame]
        self.temps: list[list] = [[]]  # per call: what the running statement holds
        self.errors: list[str] = []  # constructs the walker could not follow
        self.cell = self.line = 0

    # ---- hooks ----

    def attribute(self, value, name: str):
        """value.name for values the owner models; NOT_HANDLED for the walker's own rules."""
        return NOT_HANDLED

    def special_call(self, node: ast.Call, func, args: list, kwargs: dict):
        """A call the owner models; NOT_HANDLED for the walker's own rules."""
        return NOT_HANDLED

    def import_value(self, node: ast.Import | ast.ImportFrom, alias: ast.alias):
        """What an imported name is bound to, when it is not already a global."""
        return UNKNOWN

    def loop_work(self):
        """A mark taken before a loop the walker cuts short (see scale_loop)."""
        return None

    def scale_loop(self, mark, factor: float) -> None:
        """The loop since mark ran factor times as many iterations as were walked."""

    # ---- cells and statements ----

    def parse(self, source: str) -> ast.Module | None:
        """A cell's syntax tree, IPython magics made ``pass``; None (and an error) if invalid."""
        code = "\n".join(MAGIC.sub(r"\1pass  # ", line) if MAGIC.match(line) else line
                         for line in source.splitlines())
        try:
            return ast.parse(code)
        except SyntaxError as error:
            self.errors.append(f"cell {self.cell}: {error}")
            return None

    def block(self, body: list[ast.stmt]) -> None:
        for statement in body:
            self.statement(statement)

    def statement(self, node: ast.stmt) -> None:
        self.line = getattr(node, "lineno", self.line)
        try:
            self._statement(node)
        except (Return, Break, Continue):
            raise
        except Exception as error:  # a construct the walker does not follow
            self.errors.append(f"cell {self.cell} line {self.line}: "
                               f"{type(error).__name__}: {error}")
            for target in ast.walk(node):
                if isinstance(target, ast.Name) and isinstance(target.ctx, ast.Store):
                    self.frames[-1][target.id] = UNKNOWN
        finally:
            if not isinstance(node, (ast.For, ast.While, ast.If, ast.With, ast.Try)):
                self.temps[-1] = []

    def _statement(self, node: ast.stmt) -> None:
        if isinstance(node, ast.Expr):
            self.eval(node.value)
        elif isinstance(node, ast.Assign):
            value = self.eval(node.value)
            for target in node.targets:
                self.bind(target, value)
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            self.bind(node.target, self.eval(node.value))
        elif isinstance(node, ast.AugAssign):
            old, new = self.eval(node.target), self.eval(node.value)
            self.bind(node.target, self.binop(node.op, old, new))
        elif isinstance(node, ast.Delete):
            for target in node.targets:
                self.unbind(target)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                name = (alias.asname or alias.name).split(".")[0]
                if name not in self.frames[0] or alias.asname:
                    self.frames[-1][name] = self.import_value(node, alias)
        elif isinstance(node, ast.FunctionDef):
            defaults = [self.eval(d) for d in node.args.defaults]
            kw = {a.arg: self.eval(d) for a, d in zip(node.args.kwonlyargs,
                                                       node.args.kw_defaults) if d is not None}
            self.frames[-1][node.name] = Function(node, defaults, kw)
        elif isinstance(node, ast.ClassDef):
            self.frames[-1][node.name] = UNKNOWN
        elif isinstance(node, ast.For):
            self.loop(node)
        elif isinstance(node, ast.While):  # its body walked once; continue ends that pass too
            try:
                self.block(node.body)
            except (Break, Continue):
                pass
        elif isinstance(node, ast.If):
            test = self.eval(node.test)
            self.block(node.orelse if test is not UNKNOWN and not test else node.body)
        elif isinstance(node, ast.With):
            for item in node.items:
                value = self.eval(item.context_expr)
                if item.optional_vars is not None:
                    self.bind(item.optional_vars, value)
            self.block(node.body)
        elif isinstance(node, ast.Try):
            self.block(node.body)
            self.block(node.orelse)
            self.block(node.finalbody)
        elif isinstance(node, ast.Return):
            raise Return(self.eval(node.value) if node.value is not None else None)
        elif isinstance(node, ast.Break):
            raise Break
        elif isinstance(node, ast.Continue):
            raise Continue
        # assert, raise, pass, global: nothing to follow

    def loop(self, node: ast.For) -> None:
        iterable = self.eval(node.iter)
        values, mark = items(iterable), self.loop_work()
        try:
            for value in values:
                self.bind(node.target, value)
                try:
                    self.block(node.body)
                except Continue:
                    continue
            else:
                self.block(node.orelse)
        except Break:
            pass
        self.scale_loop(mark, length(iterable) / max(1, len(values)))

    def bind(self, target: ast.expr, value) -> None:
        if isinstance(target, ast.Name):
            self.frames[-1][target.id] = value
        elif isinstance(target, (ast.Tuple, ast.List)):
            items_ = list(value) if isinstance(value, (tuple, list)) and len(value) == len(
                target.elts) else [UNKNOWN] * len(target.elts)
            for element, item in zip(target.elts, items_):
                self.bind(element, item)
        elif isinstance(target, ast.Subscript):
            container, key = self.eval(target.value), self.eval(target.slice)
            if isinstance(container, dict) and key is not UNKNOWN:
                container[key] = value
            elif isinstance(container, list) and isinstance(key, int):
                container[key] = value
        # attributes: the object keeps its own references; nothing to follow

    def unbind(self, target: ast.expr) -> None:
        if isinstance(target, ast.Name):
            for frame in reversed(self.frames):
                if target.id in frame:
                    del frame[target.id]
                    return
        elif isinstance(target, (ast.Tuple, ast.List)):
            for element in target.elts:
                self.unbind(element)
        elif isinstance(target, ast.Subscript):
            container, key = self.eval(target.value), self.eval(target.slice)
            if isinstance(container, dict):
                container.pop(key, None)

    # ---- expressions ----

    def lookup(self, name: str):
        for frame in (self.frames[-1], self.frames[0]):
            if name in frame:
                return frame[name]
        return UNKNOWN

    def eval(self, node: ast.expr):
        method = getattr(self, f"eval_{type(node).__name__}", None)
        return UNKNOWN if method is None else method(node)

    def eval_Constant(self, node):
        return node.value

    def eval_Name(self, node):
        return self.lookup(node.id)

    def eval_Tuple(self, node):
        return tuple(self.eval(e) for e in node.elts)

    def eval_List(self, node):
        return [self.eval(e) for e in node.elts]

    def eval_Set(self, node):
        try:
            return {self.eval(e) for e in node.elts}
        except TypeError:
            return UNKNOWN

    def eval_Dict(self, node):
        result = {}
        for key, value in zip(node.keys, node.values):
            if key is None:
                merged = self.eval(value)
                if isinstance(merged, dict):
                    result.update(merged)
                continue
            try:
                result[self.eval(key)] = self.eval(value)
            except TypeError:
                pass
        return result

    def eval_IfExp(self, node):
        test = self.eval(node.test)
        if test is UNKNOWN:
            return self.eval(node.body)
        return self.eval(node.body if test else node.orelse)

    def eval_Attribute(self, node):
        value, name = self.eval(node.value), node.attr
        modelled = self.attribute(value, name)
        if modelled is not NOT_HANDLED:
            return modelled
        if isinstance(value, Namespace):
            return value.attributes.get(name, UNKNOWN)
        if isinstance(value, (dict, list, str, tuple, range, set)) and not name.startswith("_"):
            attribute = getattr(value, name, UNKNOWN)
            if callable(attribute):
                return Native(lambda walker, a, k, n, f=attribute: f(*a, **k))
            return attribute
        return UNKNOWN

    def eval_Subscript(self, node):
        value, key = self.eval(node.value), self.eval(node.slice)
        if isinstance(value, (dict, list, tuple, str, range)) and key is not UNKNOWN:
            try:
                return value[key]
            except (KeyError, IndexError, TypeError):
                return UNKNOWN
        return UNKNOWN

    def eval_Slice(self, node):
        parts = [None if p is None else self.eval(p) for p in (node.lower, node.upper, node.step)]
        return UNKNOWN if UNKNOWN in parts else slice(*parts)

    def binop(self, op, left, right):
        if left is UNKNOWN or right is UNKNOWN:
            return UNKNOWN
        try:
            return OPERATORS[type(op)](left, right)
        except Exception:
            return UNKNOWN

    def eval_BinOp(self, node):
        return self.binop(node.op, self.eval(node.left), self.eval(node.right))

    def eval_UnaryOp(self, node):
        value = self.eval(node.operand)
        if value is UNKNOWN:
            return UNKNOWN
        try:
            return {ast.USub: lambda v: -v, ast.UAdd: lambda v: +v, ast.Not: lambda v: not v,
                    ast.Invert: lambda v: ~v}[type(node.op)](value)
        except Exception:
            return UNKNOWN

    def eval_BoolOp(self, node):
        values = [self.eval(v) for v in node.values]
        if UNKNOWN in values:
            return UNKNOWN
        return all(values) if isinstance(node.op, ast.And) else any(values)

    def eval_Compare(self, node):
        left = self.eval(node.left)
        for op, comparator in zip(node.ops, node.comparators):
            right = self.eval(comparator)
            if left is UNKNOWN or right is UNKNOWN:
                return UNKNOWN
            try:
                if not COMPARISONS[type(op)](left, right):
                    return False
            except Exception:
                return UNKNOWN
            left = right
        return True

    def comprehension(self, node, element) -> list:
        """Evaluate a comprehension, element() once per item; each result is kept alive."""
        results, outer = [], []  # outer: the first for clause's iterable
        self.frames.append(dict(self.frames[-1]))

        def walk(generators):
            if not generators:
                value = element()
                self.temps[-1].append(value)
                results.append(value)
                return
            first = generators[0]
            iterable = self.eval(first.iter)
            outer.append(iterable)
            values, mark = items(iterable), self.loop_work()
            for item in values:
                self.bind(first.target, item)
                if all(self.eval(test) is not False for test in first.ifs):
                    walk(generators[1:])
            self.scale_loop(mark, length(iterable) / max(1, len(values)))

        try:
            walk(node.generators)
        finally:
            self.frames.pop()
        whole = length(outer[0]) if len(node.generators) == 1 and not node.generators[0].ifs \
            and results else 0
        if len(results) < whole <= 100_000:
            # Cut short at LOOP_LIMIT: the rest repeat the items walked, so len() stays true.
            results = [results[i % len(results)] for i in range(whole)]
        return results

    def eval_ListComp(self, node):
        return self.comprehension(node, lambda: self.eval(node.elt))

    eval_GeneratorExp = eval_ListComp

    def eval_SetComp(self, node):
        values = self.comprehension(node, lambda: self.eval(node.elt))
        try:
            return set(values)
        except TypeError:
            return UNKNOWN

    def eval_DictComp(self, node):
        pairs = self.comprehension(node, lambda: (self.eval(node.key), self.eval(node.value)))
        try:
            return dict(pairs)
        except TypeError:
            return UNKNOWN

    def eval_Call(self, node):
        func, args, kwargs = self.eval(node.func), [], {}
        for arg in node.args:
            if isinstance(arg, ast.Starred):
                value = self.eval(arg.value)
                args.extend(value if isinstance(value, (list, tuple)) else [UNKNOWN])
            else:
                args.append(self.eval(arg))
        for keyword in node.keywords:
            value = self.eval(keyword.value)
            if keyword.arg is not None:
                kwargs[keyword.arg] = value
            elif isinstance(value, dict):
                kwargs.update(value)
        self.temps[-1].extend(args)  # an argument lives at least as long as the call
        modelled = self.special_call(node, func, args, kwargs)
        if modelled is not NOT_HANDLED:
            return modelled
        if isinstance(func, Native):
            try:
                return func.fn(self, args, kwargs, node)
            except (Return, Break, Continue):
                raise
            except Exception:
                return UNKNOWN
        if isinstance(func, Function):
            return self.call(func, args, kwargs)
        return UNKNOWN

    def call(self, function: Function, args, kwargs):
        """Run a cell's own function with its arguments bound, in a frame of its own."""
        if len(self.frames) > 20:
            return UNKNOWN
        spec, frame, extra = function.node.args, {}, {}
        names = [a.arg for a in spec.posonlyargs + spec.args]
        keyword_only = [a.arg for a in spec.kwonlyargs]
        defaults = dict(zip(names[len(names) - len(function.defaults):], function.defaults))
        frame.update(zip(names, args))
        if spec.vararg is not None:
            frame[spec.vararg.arg] = tuple(args[len(names):])
        for name, value in kwargs.items():
            (frame if name in names or name in keyword_only else extra)[name] = value
        for name in names:
            frame.setdefault(name, defaults.get(name, UNKNOWN))
        for name in keyword_only:
            frame.setdefault(name, function.kw_defaults.get(name, UNKNOWN))
        if spec.kwarg is not None:
            frame[spec.kwarg.arg] = extra
        self.frames.append(frame)
        self.temps.append([])
        try:
            self.block(function.node.body)
            value = None
        except Return as returned:
            value = returned.value
        finally:
            self.frames.pop()
            self.temps.pop()
        self.temps[-1].append(value)
        return value
