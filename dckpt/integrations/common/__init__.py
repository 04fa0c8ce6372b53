"""What every framework adapter does the same way, framework-free (no Lightning,
Accelerate or transformers import): the dckpt tree of a training state and its load
(:mod:`.tree`, :mod:`.codec`, :mod:`.states`, :mod:`.rng`), placement under the name
once committed (:mod:`.place`, :mod:`.commit`), the newest committed checkpoint in
commit order with fallback (:mod:`.resolve`) and rotation in commit order
(:mod:`.rotation`). An adapter package imports this package, never another adapter's."""
