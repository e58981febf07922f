"""Query templates: the prompt a pseudo-word (``*``) and one description field are joined into.

``a photo of * , {text}`` is the paper's CIRR prompt. A template is literal text, one ``*``
and one plain field of :data:`TEMPLATE_FIELDS`; it is filled by joining its parts, never by
``str.format`` (no format specs, conversions, attribute or index access). Torch-free, so a
config that names a template is checked without loading a model; :mod:`demind.model` fills
them.
"""

from __future__ import annotations

import string

from demind.errors import DemindError

PLACEHOLDER = "*"  # the pseudo-word token's text; the backbone finds it by token id

TEMPLATES = {
    "cirr": "a photo of * , {text}",
    "domain": "a {domain} of *",
    "objects": "a photo of * , {objects}",
}

TEMPLATE_FIELDS = ("text", "domain", "objects")  # the fields the templates above fill
MAX_TEMPLATE_CHARS = 1000  # a prompt is cut to CLIP's 77 tokens anyway


class TemplateError(DemindError, ValueError):
    """A query template that is not ``literal text + one '*' + one plain {field}``; the message says why."""


def _template_parts(template: str) -> list[tuple[str, str | None]]:
    """``"a {domain} of *"`` -> ``[("a ", "domain"), (" of *", None)]``: literal text and plain field names.

    Only bare names from :data:`TEMPLATE_FIELDS` are fields: a format spec (``{text:>100000000}``
    would pad to 100 MB), a conversion (``{text!r}``), attribute or index access
    (``{text.__class__}``, ``{text[0]}``) and positional fields (``{}``, ``{0}``) are refused, so
    filling a template costs no more than joining its parts."""
    if not isinstance(template, str):
        raise TemplateError(f"the template must be a text such as {TEMPLATES['cirr']!r}, got {type(template).__name__}")
    shown = template if len(template) <= 80 else template[:77] + "..."
    if len(template) > MAX_TEMPLATE_CHARS:
        raise TemplateError(f"the template is {len(template):,} characters; at most {MAX_TEMPLATE_CHARS:,} are "
                            f"allowed, e.g. {TEMPLATES['cirr']!r}")
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError:  # an unmatched '{' or '}'
        raise TemplateError(f"template {shown!r} has an unmatched '{{' or '}}'; write a literal brace as "
                            f"'{{{{' or '}}}}', e.g. {TEMPLATES['cirr']!r}") from None
    parts: list[tuple[str, str | None]] = []
    for literal, name, spec, conversion in parsed:
        if name is None:
            parts.append((literal, None))
            continue
        field = "{" + name + (f"!{conversion}" if conversion else "") + (f":{spec}" if spec else "") + "}"
        if conversion or spec:
            problem = "a conversion" if conversion else "a format spec"
            raise TemplateError(f"template {shown!r}: field {field[:40]} has {problem}; fields are plain names "
                                f"such as '{{text}}'")
        if name not in TEMPLATE_FIELDS:
            raise TemplateError(f"template {shown!r}: field {field[:40]} is not one of "
                                f"{', '.join('{' + f + '}' for f in TEMPLATE_FIELDS)} (no positional fields, "
                                f"attribute or index access)")
        parts.append((literal, name))
    return parts


def template_field(template: str) -> str:
    """The one ``{field}`` a query template takes: ``"a {domain} of *"`` -> ``"domain"``.

    TemplateError when the template holds not exactly one ``*`` and one plain field (see
    :func:`_template_parts`)."""
    fields = {name for _, name in _template_parts(template) if name}
    if len(fields) != 1 or template.count(PLACEHOLDER) != 1:
        shown = template if len(template) <= 80 else template[:77] + "..."
        raise TemplateError(f"a query template needs one {PLACEHOLDER!r} (the reference image's pseudo-word) and "
                            f"one field such as '{{text}}', got {shown!r}")
    return fields.pop()


def fill_template(template: str, **fields: str) -> str:
    """``fill_template("a photo of * , {text}", text="red")`` -> ``"a photo of * , red"``.

    The parts are joined, never ``str.format``-ed, so a template cannot pad, convert or reach
    into attributes (TemplateError instead). A ``*`` inside a field value would be read as a
    placeholder; it becomes a space.
    """
    clean = {k: " ".join(str(v).replace(PLACEHOLDER, " ").split()) for k, v in fields.items()}
    out = []
    for literal, name in _template_parts(template):
        out.append(literal)
        if name is not None:
            if name not in clean:
                raise TemplateError(f"template field {{{name}}} has no value; give {name}=...")
            out.append(clean[name])
    return "".join(out)
