"""Drop-in adapters that give tfla ops the names, keywords and layouts of other kernel libraries."""
