"""Links from the docs into the rest of the repository (reports, drafters, tests): a mkdocs hook.

The pages link to repository files by relative path, which works on GitHub and in a checkout. mkdocs knows only the
files under `docs/`, so mkdocs.yml reports links it cannot find at info level, and this hook checks each relative
link against the files on disk instead: a missing one is a warning, which `mkdocs build --strict` turns into a
failure. With `repo_url` set in mkdocs.yml, links that leave `docs/` are rewritten to the repository's web pages
(images to their raw files), so they work on the built site too.
"""

from __future__ import annotations

import re
from pathlib import Path

from mkdocs.plugins import get_plugin_logger

log = get_plugin_logger(__name__)
LINK = re.compile(r"(!?)\[([^\]]*)\]\(([^)\s]+)\)")


def on_page_markdown(markdown: str, page, config, files) -> str:
    docs = Path(config.docs_dir).resolve()
    root = docs.parent
    source = Path(page.file.abs_src_path).resolve()

    def check(match: re.Match) -> str:
        image, text, target = match.groups()
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith(("#", "/")):
            return match.group(0)
        path = (source.parent / target.split("#", 1)[0]).resolve()
        if not path.exists():
            log.warning(f"{page.file.src_uri} links to {target}, which does not exist")
            return match.group(0)
        if docs in path.parents or path == docs or not config.repo_url:
            return match.group(0)
        kind = "raw" if image else "blob"
        return f"{image}[{text}]({config.repo_url.rstrip('/')}/{kind}/HEAD/{path.relative_to(root).as_posix()})"

    return LINK.sub(check, markdown)
