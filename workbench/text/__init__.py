"""Text fit for a published page: the one Markdown table writer (``markdown``) and text with
no absolute path of the machine that built it (``portable``)."""
