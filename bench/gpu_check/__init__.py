"""The GPU check: one command that measures everything the book needs a GPU for (see __main__)."""
