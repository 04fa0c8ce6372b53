"""What every framework adapter does the same way, free of any framework: placing a
committed checkpoint under the name the framework gave (:mod:`.place`)."""
