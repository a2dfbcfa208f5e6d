"""The commands: records decoded and routed to their handlers, answered exactly once
(``dispatcher``, ``received``); LOOKUP and the lookups waiting for saves in flight (``lookup``,
``lookup_waits``); SAVE and LOAD checked, planned and handed to the copy backend
(``transfers``, ``copy_arguments``, ``pending_copy``), LOADs waiting for disk reads
(``load_waits``); and commands that held up the loop (``slow_commands``)."""
