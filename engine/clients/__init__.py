"""The clients as the engine sees them: one attached client and its registered KV memory
(``client``), the table of them, claimed, retired and reclaimed (``client_table``), what a
client writes where the engine reads it (``claims``), and its REGISTER commands checked
(``registration``)."""
