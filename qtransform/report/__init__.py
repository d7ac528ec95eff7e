"""Result pages: one self-contained HTML page per result (docs/reports.md)."""
