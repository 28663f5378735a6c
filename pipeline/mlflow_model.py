"""The registered pyfunc model, logged from code (MLflow "models from code"): loading it runs this
file instead of unpickling anything. predict(prompts) generates with the bundle's engine."""

import mlflow

from draftsmith.pipeline.registry_model import BundleModel

mlflow.models.set_model(BundleModel())
