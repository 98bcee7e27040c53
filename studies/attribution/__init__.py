"""Attribution studies (``workbench attribute``): attribution maps scored against exact token-drop effects."""
