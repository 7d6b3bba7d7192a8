from shared.service import main
from shared.worker.config import add_worker_args, worker_config

from services.prefill.service import PrefillService

if __name__ == "__main__":
    main("prefill", lambda config, args: PrefillService(config, worker_config(args)), add_worker_args)
