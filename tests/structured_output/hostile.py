"""Hostile constraints, as an outside probe of the server sent them (each ≤ 110 KiB, or the one 1.4 MB
grammar), shared by the sandbox's tests and the live server's."""

from __future__ import annotations


def ref_chain(n: int = 3000) -> dict:
    """A JSON schema whose $ref chain is n definitions long."""
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    return {"$defs": {**defs, f"d{n}": {"type": "integer"}}, "$ref": "#/$defs/d0"}


def nested_objects(n: int = 1000) -> dict:
    """Objects nested n deep through $defs."""
    defs = {f"d{i}": {"type": "object", "properties": {"a": {"$ref": f"#/$defs/d{i + 1}"}}, "required": ["a"]}
            for i in range(n)}
    return {"$defs": {**defs, f"d{n}": {"type": "integer"}}, "$ref": "#/$defs/d0"}


def lark_chain(n: int = 3000) -> str:
    return "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(n)) + f'r{n}: "x"\n'


def gbnf_chain(n: int = 5000) -> str:
    return "root ::= r0\n" + "".join(f"r{i} ::= r{i + 1}\n" for i in range(n)) + f'r{n} ::= "x"\n'


def gbnf_alternatives(n: int = 100_000) -> str:
    return "root ::= " + " | ".join(f'"w{i}"' for i in range(n)) + "\n"


SELF_REFERENCE = {"$ref": "#"}
SELF_DEFINITION = {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
NEVER_ENDS = 'root ::= "a" root\n'
