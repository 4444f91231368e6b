"""MkDocs hooks of the documentation site (mkdocs.yml, ``hooks:``).

lsn_ext's docstrings name other objects with Sphinx roles (``:func:`~lsn_ext.predict```) and
write formulas as ``.. math::`` blocks, which mkdocstrings renders as they are. In the pages'
HTML, a role becomes the code span of its target (``~`` keeps the last dotted part, as Sphinx
shows it) and a ``.. math::`` line is dropped, leaving the formula's code block below it.
"""

import re

ROLE = re.compile(r":(?:func|class|meth|mod|attr|data|exc|obj):<code>(~?)([\w.]+)</code>")
MATH = re.compile(r"<p>\.\. math::</p>\n?")


def _role(match: re.Match) -> str:
    short, target = match.groups()
    return f"<code>{target.rsplit('.', 1)[-1] if short else target}</code>"


def on_page_content(html: str, **kwargs: object) -> str:
    """The page's HTML with Sphinx roles as code spans and without ``.. math::`` lines.

    Args:
        html: The HTML of one page, as MkDocs and its plugins rendered it.
        **kwargs: MkDocs' other arguments of the event (page, config, files), unused.

    Returns:
        The HTML with the two replacements.
    """
    return MATH.sub("", ROLE.sub(_role, html))
