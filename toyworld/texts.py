"""Texts about toy scenes: web alt-texts (T_ori), full descriptions (T_rew),
pseudo-manipulation instructions (T_int) and benchmark modification texts.

Every text is *true of the image it is paired with* (an alt-text may omit, never lie;
"remove the triangle" is paired with an image that has no triangle). Modification texts
are written from the difference between two scene specs (:func:`world.scene_diff`).

Phrasing pools (see README): each construction has several surface templates, tagged
with the pools that use them: ``w`` web (backbone training text; holds every template,
because a web CLIP has seen all common phrasings), ``l`` the LLM that writes T_int,
``a`` the benchmark's annotators. ``l`` and ``a`` overlap but differ, and neither uses a
construction the web pool lacks.
"""

from __future__ import annotations

import random

from .world import IMPLICIT, THEMES, Change, Scene, ToyObject, scene_diff, strip_theme

POOLS = ("web", "llm", "annotator")
_POOL_TAG = {"web": "w", "llm": "l", "annotator": "a"}

WEB_NOISE_PREFIX = ("stock image of", "picture of", "image:", "free download:", "close up of", "photo:")
WEB_NOISE_SUFFIX = ("stock image", "wallpaper", "hd", "free download", "clipart", "vector illustration",
                    "royalty free", "high resolution")


def article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def with_article(phrase: str) -> str:
    return f"{article(phrase)} {phrase}"


def position_phrase(position: str) -> str:
    """'left' -> 'on the left', 'top left' -> 'at the top left', 'center' -> 'in the center'."""
    if position == "center":
        return "in the center"
    if position in ("left", "right"):
        return f"on the {position}"
    return f"at the {position}"


def noun_phrase(obj: ToyObject, rng: random.Random | None = None, p_colour: float = 1.0,
                p_size: float = 1.0, p_position: float = 0.0) -> str:
    """'large red circle' with each attribute kept with its probability (no article)."""
    rng = rng or random.Random(0)
    words = []
    if rng.random() < p_size:
        words.append(obj.size)
    if rng.random() < p_colour:
        words.append(obj.colour)
    words.append(obj.shape)
    phrase = " ".join(words)
    if rng.random() < p_position:
        phrase += " " + position_phrase(obj.position)
    return phrase


def join_list(items: list[str], rng: random.Random) -> str:
    if len(items) == 1:
        return items[0]
    if rng.random() < 0.5:
        return ", ".join(items[:-1]) + " and " + items[-1]
    return " and ".join(items)


# --------------------------------------------------------------- T_ori: web alt-text

# An alt-text of a themed image names its decor at a usual
# alt-text rate, and the theme word itself seldom.
P_ALT_DECOR = 0.4
P_ALT_THEME = 0.03


def alt_text(scene: Scene, rng: random.Random) -> str:
    """A short, incomplete web caption: a subset of objects and attributes, maybe noise."""
    objs = list(scene.objects)
    rng.shuffle(objs)
    keep = objs[:1] if rng.random() < 0.5 else objs[: rng.randint(1, len(objs))]
    phrases = [noun_phrase(o, rng, p_colour=0.65, p_size=0.3, p_position=0.15) for o in keep]
    phrases = [with_article(p) if rng.random() < 0.6 else p for p in phrases]
    text = join_list(phrases, rng)
    if len(keep) < len(objs) and rng.random() < 0.15:
        text = f"{len(objs)} shapes, {text}" if rng.random() < 0.5 else f"{text} and other shapes"
    if scene.decor and rng.random() < P_ALT_DECOR:
        text += " with " + join_list(list(scene.decor), rng)
    if scene.theme is not None and rng.random() < P_ALT_THEME:  # web text seldom names a theme
        bundle = THEMES[scene.theme]
        text = rng.choice((f"{text}, {bundle.name}", f"{bundle.adjective} {text}", f"{bundle.name} scene: {text}"))
    if rng.random() < 0.3:
        text += f" on {scene.background}"
    if scene.style != "photo" and rng.random() < 0.7:
        text = rng.choice((f"{scene.style} {text}", f"{article(scene.style)} {scene.style} of {text}",
                           f"{text}, {scene.style}"))
    elif scene.style == "photo" and rng.random() < 0.15:
        text = f"a photo of {text}"
    if rng.random() < 0.3:
        text = (f"{rng.choice(WEB_NOISE_PREFIX)} {text}" if rng.random() < 0.5
                else f"{text} {rng.choice(WEB_NOISE_SUFFIX)}")
    return text


# --------------------------------------------------------- T_rew: full description

def full_description(scene: Scene, rng: random.Random) -> str:
    """Every object with size, colour and position; the background; the style."""
    objs = [f"{with_article(noun_phrase(o))} {position_phrase(o.position)}" for o in scene.objects]
    listed = join_list(objs, rng)
    n = len(scene.objects)
    count = {1: "one object", 2: "two objects", 3: "three objects"}[n]
    style = f"{article(scene.style)} {scene.style}"
    template = rng.randrange(3)
    if template == 0:
        text = f"{style.capitalize()} of {listed}, on a {scene.background} background."
    elif template == 1:
        text = (f"The image is {style} showing {count}: {listed}. "
                f"The background is {scene.background}.")
    else:
        text = f"{style.capitalize()} with {count} on {scene.background}: {listed}."
    return text + _decor_and_details(scene)


def _decor_and_details(scene: Scene) -> str:
    """' The scene has falling leaves. Around them: a fence and a cloud.' ('' for a bare scene).
    Names what is visible; never the theme."""
    text = ""
    if scene.decor:
        text += " The scene has " + " and ".join(scene.decor) + "."
    if scene.details:
        text += " Around them: " + " and ".join(with_article(d.kind) for d in scene.details) + "."
    return text


def partial_target_description(scene: Scene, focus: list[ToyObject], rng: random.Random,
                               with_background: bool, with_style: bool = False) -> str:
    """'a small red circle on sand': the objects in ``focus`` (and maybe the background);
    the style is named when it is not a photo or when ``with_style``."""
    phrases = [with_article(noun_phrase(o, rng, p_colour=1.0, p_size=0.5, p_position=0.3)) for o in focus]
    text = join_list(phrases, rng)
    if with_background:
        text += f" on {scene.background}"
    if scene.style != "photo" or with_style:
        text = f"{article(scene.style)} {scene.style} of {text}"
    return text


# ------------------------------------------------------------- modification texts

# Each template: (pools, format string). Fields: S shape, c0/c1 colours, np noun phrase,
# S0/S1 shapes, big comparative, sz size word, pos position phrase, cell cell name,
# bg0/bg1 backgrounds, st0/st1 styles, a1 article of the new thing.
TEMPLATES: dict[str, list[tuple[str, str]]] = {
    "colour": [
        ("wla", "make the {S} {c1}"),
        ("wl", "change the color of the {S} to {c1}"),
        ("wa", "change the {c0} {S} to {c1}"),
        ("wl", "turn the {c0} {S} {c1}"),
        ("wa", "{a1} {c1} {S} instead of {a0} {c0} one"),
        ("wa", "the {S} should be {c1}"),
        ("wl", "{c1} {S} instead of {c0}"),
        ("wla", "color the {S} {c1}"),
    ],
    "shape": [
        ("wla", "replace the {np0} with {a1} {np1}"),
        ("wl", "change the {np0} into {a1} {np1}"),
        ("wa", "turn the {np0} into {a1} {np1}"),
        ("wla", "{a1} {np1} instead of the {np0}"),
        ("wa", "swap the {np0} for {a1} {np1}"),
        ("wl", "make the {np0} {a1} {np1}"),
    ],
    "size": [
        ("wla", "make the {S} {big}"),
        ("wl", "make the {S} {sz}"),
        ("wa", "{a1} {big} {S}"),
        ("wa", "the {S} should be {big}"),
        ("wl", "{verb} the {S}"),
    ],
    "position": [
        ("wla", "move the {S} to the {cell}"),
        ("wa", "put the {S} {pos}"),
        ("wl", "the {S} {pos} instead"),
        ("wl", "place the {S} {pos}"),
    ],
    "add": [
        ("wla", "add {a1} {np1}"),
        ("wa", "put {a1} {np1} in the picture"),
        ("wl", "with an extra {np1}"),
        ("wa", "also show {a1} {np1}"),
        ("wl", "include {a1} {np1}"),
    ],
    "remove": [
        ("wla", "remove the {np0}"),
        ("wla", "without the {np0}"),
        ("wa", "take away the {np0}"),
        ("wl", "delete the {np0}"),
        ("wa", "get rid of the {np0}"),
        ("w", "no {np0}"),
    ],
    "background": [
        ("wla", "change the background to {bg1}"),
        ("wl", "put it on {bg1}"),
        ("wa", "on {bg1} instead of {bg0}"),
        ("wa", "make the background {bg1}"),
        ("wl", "place it on {bg1}"),
        ("wa", "with {a1} {bg1} background"),
    ],
    "style": [
        ("wla", "make it {a1} {st1}"),
        ("wl", "turn it into {a1} {st1}"),
        ("wa", "as {a1} {st1}"),
        ("wa", "{a1} {st1} version"),
        ("wl", "change the style to {st1}"),
    ],
}
# Themes. The annotator names the theme only, as a user writes it; the LLM names it
# with its realisation, as an MLLM explains an intent; the web pool has both (rarely drawn).
TEMPLATES[IMPLICIT] = [
    ("wa", "make it feel like {noun}"),
    ("wa", "give it {a_adj} {adj} look"),
    ("wa", "{a_adj} {adj} version"),
    ("wa", "the same scene {when}"),
    ("wl", "make this photo feel like {noun}: {realisation}"),
    ("wl", "give it {a_adj} {adj} look with {realisation}"),
    ("wl", "turn it into {a_adj} {adj} scene: {realisation}"),
]
TARGET_DESCRIPTION_TEMPLATES: list[tuple[str, str]] = [
    ("wa", "shows {desc}"),
    ("a", "the target shows {desc}"),
    ("wa", "{desc}"),
    ("a", "the target photo has {desc}"),
    ("wl", "so it shows {desc}"),
]
KEEP_TEMPLATES: list[tuple[str, str]] = [
    ("wla", "keep the {np}"),
    ("wl", "leave the {np} as it is"),
    ("wa", "with the same {np}"),
]


def _templates(items: list[tuple[str, str]], pool: str) -> list[str]:
    tag = _POOL_TAG[pool]
    return [t for tags, t in items if tag in tags]


def _np(obj: ToyObject, rng: random.Random, full: bool = False) -> str:
    if full:
        return noun_phrase(obj)
    return noun_phrase(obj, rng, p_colour=0.7, p_size=0.3)


def describe_change(change: Change, rng: random.Random, pool: str) -> str:
    """One change as a short instruction drawn from ``pool``'s templates."""
    templates = _templates(TEMPLATES[change.kind], pool)
    template = rng.choice(templates)
    fields: dict[str, str] = {}
    b, a = change.before, change.after
    if change.kind in ("colour", "size", "position"):
        fields.update(S=b.shape, c0=b.colour, c1=a.colour, cell=a.position, pos=position_phrase(a.position),
                      sz=a.size, big="bigger" if a.size == "large" else "smaller",
                      verb="enlarge" if a.size == "large" else "shrink")
        fields.update(a0=article(b.colour), a1=article(a.colour if change.kind == "colour" else fields["big"]))
    elif change.kind == "shape":
        np0 = noun_phrase(b, rng, p_colour=0.5, p_size=0.0)
        # the new object is named with the attributes that differ from the old one
        np1 = noun_phrase(a, rng, p_colour=1.0 if a.colour != b.colour else 0.4,
                          p_size=1.0 if a.size != b.size else 0.0)
        if a.position != b.position:
            np1 += " " + position_phrase(a.position)
        fields.update(np0=np0, np1=np1, a1=article(np1))
    elif change.kind == "add":
        np1 = noun_phrase(a, rng, p_colour=0.9, p_size=0.5, p_position=0.5)
        fields.update(np1=np1, a1=article(np1))
    elif change.kind == "remove":
        fields.update(np0=_np(b, rng))
    elif change.kind == "background":
        fields.update(bg0=change.old, bg1=change.new, a1=article(change.new))
    elif change.kind == "style":
        fields.update(st0=change.old, st1=change.new, a1=article(change.new))
    elif change.kind == IMPLICIT:
        bundle = THEMES[change.new]
        fields.update(noun=rng.choice(bundle.nouns), adj=bundle.adjective, a_adj=article(bundle.adjective),
                      when=bundle.when, realisation=theme_realisation(change, rng))
    return template.format(**fields)


def theme_realisation(change: Change, rng: random.Random) -> str:
    """What an implicit change means concretely: 'orange and yellow shapes, falling leaves,
    on leaves' (the target's palette colours, the decor, the theme's background)."""
    bundle = THEMES[change.new]
    parts = [join_list(list(change.colours), rng) + (" shapes" if len(change.colours) > 1 else " objects")]
    parts.append(" and ".join(bundle.decor))
    if bundle.background is not None:
        parts.append(f"on {bundle.background}")
    return ", ".join(parts)


def _changed_objects(target: Scene, changes: list[Change]) -> list[ToyObject]:
    ids = {c.after.oid for c in changes if c.after is not None}
    return [o for o in target.objects if o.oid in ids]


def modification_text(source: Scene, target: Scene, rng: random.Random, pool: str,
                      p_description: float, p_keep: float, p_background: float = 0.3,
                      p_context: float = 0.0) -> str:
    """A text that turns ``source`` into ``target``.

    With probability ``p_description`` it is a partial description of the target (as
    "shows a red circle on sand": the changed objects, with probability ``p_context`` every
    object of the target, and the background with probability ``p_background`` or when it
    changed), otherwise instructions, one per change, joined; then with probability
    ``p_keep`` a clause naming an unchanged object to keep. ``p_context=0`` draws nothing
    more, so texts written before it existed stay as they were.
    """
    changes = scene_diff(source, target)
    if not changes:
        raise ValueError("source and target scenes are identical; nothing to describe")
    implicit = any(c.kind == IMPLICIT for c in changes)
    # a theme is said as an instruction: a target description would spell out its realisation
    if rng.random() < p_description and not implicit:
        focus = _changed_objects(target, changes) or [rng.choice(target.objects)]
        if p_context and rng.random() < p_context:
            focus = list(target.objects)
        bg = any(c.kind == "background" for c in changes) or rng.random() < p_background
        restyled = any(c.kind == "style" for c in changes)
        removed = [c.before for c in changes if c.kind == "remove"]
        desc = partial_target_description(target, focus, rng, bg, with_style=restyled)
        if removed:
            desc += " without the " + " or the ".join(_np(o, rng) for o in removed)
        text = rng.choice(_templates(TARGET_DESCRIPTION_TEMPLATES, pool)).format(desc=desc)
    else:
        parts = [describe_change(c, rng, pool) for c in changes]
        text = join_list(parts, rng)
    touched = {c.after.oid for c in changes if c.after is not None} | {c.before.oid for c in changes if c.before}
    if implicit:  # a theme recolours every object: none is "kept" as it was
        touched |= {o.oid for o in target.objects}
    kept = [o for o in target.objects if o.oid not in touched]
    if kept and rng.random() < p_keep:
        text += ", " + rng.choice(_templates(KEEP_TEMPLATES, pool)).format(np=_np(rng.choice(kept), rng))
    return text


def pseudo_manipulation(source: Scene, target: Scene, rng: random.Random) -> str:
    """T_int: the LLM-style instruction that would produce ``target`` from ``source``."""
    return modification_text(source, target, rng, "llm", p_description=0.15, p_keep=0.3)


def annotator_text(reference: Scene, target: Scene, rng: random.Random) -> str:
    """A benchmark modification text, in the mix of CIRR's captions (about half describe
    the target, half instruct)."""
    return modification_text(reference, target, rng, "annotator", p_description=0.4, p_keep=0.2)


def web_edit_text(source: Scene, target: Scene, rng: random.Random) -> str:
    """An edit-form web caption true of ``target`` (how-to pages, product variants)."""
    return modification_text(source, target, rng, "web", p_description=0.2, p_keep=0.2)


# The share of themed images whose hypothetical source is the unthemed scene, so that
# their edit text (T_int, or a rare web edit caption) is the theme itself.
P_THEME_SOURCE = 0.5


def hypothetical_source(scene: Scene, rng: random.Random) -> Scene:
    """A scene 1–2 random edits away from ``scene`` (the "similar image" an edit starts from);
    for a themed scene, with probability P_THEME_SOURCE the scene without its theme."""
    from .world import random_edit

    if scene.theme is not None and rng.random() < P_THEME_SOURCE:
        return strip_theme(scene, rng)
    num_edits = 1 if rng.random() < 0.7 else 2
    source, kinds = scene, []
    for _ in range(num_edits):
        kind, source = random_edit(source, rng, exclude=tuple(kinds))
        kinds.append(kind)
    if source.canonical() == scene.canonical():  # two edits that undo each other
        _, source = random_edit(scene, rng)
    return source


# Mixture of the backbone's training text: edit-form text is rare in web text, so it gets a small
# share; alt-texts and full descriptions keep the 9 : 4 ratio of the first world.
WEB_TEXT_MIX = {"alt": 0.675, "full": 0.30, "edit": 0.025}


def web_text(scene: Scene, rng: random.Random) -> str:
    """One backbone ("web CLIP") training caption for ``scene``, true of it, drawn from WEB_TEXT_MIX."""
    mix = WEB_TEXT_MIX
    kind = rng.choices(list(mix), list(mix.values()))[0]
    if kind == "alt":
        return alt_text(scene, rng)
    if kind == "full":
        return full_description(scene, rng)
    return web_edit_text(hypothetical_source(scene, rng), scene, rng)
