"""Result pages: one self-contained HTML page per result (docs/reports.md).

`Page` builds a page (page.py); `scan_page`, `compare_page`, `sensitivity_page`, `guide_page`
(scan_pages.py), `parity_page`, `export_page` and `index_page` (run_pages.py) compose the page of
each result; `write_scan_page` adds the per-site histograms that need the scanned weights.
"""

from qtransform.report.page import Page, page_beside
from qtransform.report.run_pages import export_page, index_page, parity_page
from qtransform.report.scan_pages import (
    compare_page,
    guide_page,
    scan_page,
    sensitivity_page,
    write_scan_page,
)

__all__ = ["Page", "compare_page", "export_page", "guide_page", "index_page", "page_beside",
           "parity_page", "scan_page", "sensitivity_page", "write_scan_page"]
