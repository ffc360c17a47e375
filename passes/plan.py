"""Plan: decide, per site, whether to rewrite it, how, and in how many chunks.

The decision is a pure function of the site's shapes, the options and the hardware
profile, so every rank reaches the same plan (a rank that planned differently would
issue different collectives and deadlock).
"""
from __future__ import annotations

from overlapc.options import Options

from .sites import MatchedSite


def plan_sites(sites: list[MatchedSite], options: Options) -> None:
    for site in sites:
        per_site = options.for_site(site.name)
        strategy = per_site["strategy"]
        if strategy == "none":
            site.status, site.strategy = "found", None
            continue
        site.status = "skipped"
        site.reason = f"no rewrite for {site.pattern} sites yet"
