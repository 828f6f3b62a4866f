"""A job's state in the result backend's Redis, without Celery.

:mod:`~chkq.jobs.keys` names every key, :mod:`~chkq.jobs.sealed` seals and
checks every value, :mod:`~chkq.jobs.records` holds the records of a job's
steps and life, :mod:`~chkq.jobs.paths` re-checks the paths they name,
:mod:`~chkq.jobs.proof` is the link's proof and :mod:`~chkq.jobs.status` the
read model ``chkq status`` shows. Each takes a Redis client (and the record
key) as arguments: the task layer binds them to its app.
"""
